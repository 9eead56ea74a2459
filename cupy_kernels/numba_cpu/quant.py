"""A numba matmul over GGUF blocks (quant.py) for the few-row matmuls of decode steps.

A decode step with few sequences multiplies a handful of activation rows by every weight of the model, so
it is bound by streaming the weights from memory: 540 MB of float32 per step for SmolLM2-135M, against
96 MB as the file stores them (Q4_1 layers, Q8_0 embedding). This kernel reads the blocks: per block of 32
weights one 16-byte (Q4) or 32-byte (Q8) load, the quants widened to float32 in vector registers, and the
activations of up to four rows multiplied against them before the next block is loaded.

Each block is dequantized in registers to its float32 weights w = d q + m (Q4; for Q4_0 m = -8 d) or
w = d q (Q8), the exact values of the float32 weights (quant.py), and each row adds w x with one FMA per
weight into two 16-lane accumulators (the block's first and second 16 weights: two independent chains),
summed once at the end of the weight row:

    y[r, n] = sum_b sum_i w[n, b, i] x[r, 32 b + i]

With AVX-512 the Q4 weights come from a table: the block's 16 possible values d * (0..15) + m, one FMA,
then one vpermps per 16 nibbles looks them up (no int-to-float conversions). numba does not vectorise
this loop (the per-block scale breaks its reduction), so the loop body is written as LLVM vector IR (an
@intrinsic, as numba_ops.row_max). A weight row is reached by pointer arithmetic, so the loop over rows
makes no array views (numba reference-counts each one).

SmolLM2's 30 layers' four matmuls, 2 threads, medians of 9 interleaved rounds against the kernel before
(which multiplied sum_i q x by d per block and added sum_b m * (sum of the block's x) per output, with views):
on an AVX-512 Xeon (Emerald Rapids, 2 vCPUs of a noisy host) 1 row 9.8 -> 8.0 ms, 2 rows 11.9 -> 9.0,
4 rows 18.5 -> 12.4, 6 rows 29.8 -> 20.9; the Q8 lm_head 2.4 -> 2.3 ms. Compiled as AVX2 code on the same
host: 1 row 13.2 -> 10.9 ms, 3 rows 24.3 -> 17.7, 4 rows (3 + 1) 24.0 -> 24.1. On the earlier AMD Zen 4
VM the old kernel took 2.5-3.2 ms at 1 row; figures move with the host far more than between kernels.

The weights are exact (quant.py), so the result differs from the float32 reference only in rounding (the
order of the sums; each product is fused into its sum).
Above QUANT_MAX_ROWS rows the packed float32 GEMM (numba_gemm.py) is faster (both are compute-bound
there, and it does fewer operations per product), and numba_ops.linear takes that path.
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import quant_int8
from .gemm import AVX512
from .vector_ir import lane_sums, splat
from .launch import array2, item_address, run_parts
from .setup import JIT, apply_threads, call_compiled, native_address, numba
from ..reference.quant import BLOCK, QuantWeight

# Rows up to which a quantized weight takes this kernel; above, the packed float32 GEMM (numba_gemm.py) is
# faster. SmolLM2's 30 layers on the test VM, this kernel vs the GEMM (which streams 425 MB, so its few-row
# times follow the host's memory bandwidth): 1 row 4.1 vs 10.0 ms, 4 rows 6.2 vs 9.6, 6 rows 9.0 vs 10.7,
# 8 rows 11.8 vs 9.9, 16 rows 25.1 vs 12.1. With the table lookup on the Xeon: 4 rows 12.5 vs 22.1 ms,
# 6 rows 20.6 vs 25.3, 8 rows 23.8 vs 22.5, 10 rows 34.5 vs 30.5.
QUANT_MAX_ROWS = 6
_LANES = 16  # float32 lanes per accumulator (one AVX-512 register, two AVX2 ones)
# Rows per pass over a weight row (one intrinsic each), then 2 and 1 for the rest. Each row keeps two
# accumulators: 4 rows take 8 of AVX-512's 32 registers; in AVX2 code each is two of 16 registers, so
# 4 rows would spill and 3 do not.
_BIG_ROWS = 4 if AVX512 else 3
# Weight rows ahead whose blocks each row's pass hints into the cache (llvm.prefetch). The hardware
# prefetcher follows each stream only within a 4 KB page and has three per thread here (quants, scales,
# mins). Medians of 11 rounds interleaved in one process, SmolLM2's 30 layers and its Q8 lm_head, 2
# threads, Emerald Rapids VM: 1 row 6.4-7.9 -> 5.4-7.2 ms and the lm_head 1.9-2.2 -> 1.3-1.6; 4 rows
# 9.8-13.2 -> 9.6-13.7 (unchanged); 2, 6 and 8 rows ahead did about as well as 4 at 1 row.
_PREFETCH_ROWS = 4


def _block_dot(rows: int):
    """An intrinsic dot(qs, scales, mins, n, x_flat, start, k) -> UniTuple(float32, rows): for weight row n,
    sum_i w_i * x[start + j k + i] for j < rows, with w the row's dequantized weights: block b is
    d[n, b] q + m[n, b] when `qs` is uint8 (q4, two quants a byte), d[n, b] q when it is int8 (q8; `mins`
    is then not read). qs, scales and mins 2-D and x 1-D, all C-contiguous; k a multiple of 32. The row is
    found by pointer arithmetic, not as a view."""

    @intrinsic
    def dot(typingctx, qs, scales, mins, n, x, start, k):
        if not isinstance(qs, types.Array) or qs.dtype not in (types.int8, types.uint8):
            return None
        kind = "q8" if qs.dtype == types.int8 else "q4"
        for a, ndim in ((qs, 2), (scales, 2), (mins, 2), (x, 1)):
            if not (isinstance(a, types.Array) and a.ndim == ndim and a.layout == "C"
                    and (a is qs or a.dtype == types.float32)):
                return None
        if not all(isinstance(v, types.Integer) for v in (n, start, k)):
            return None
        sig = types.UniTuple(types.float32, rows)(qs, scales, mins, n, x, start, k)

        def codegen(context, builder, signature, args):
            n_v = context.cast(builder, args[3], signature.args[3], types.intp)

            def row(i):  # pointer to row n of 2-D C-contiguous array argument i
                arr = context.make_array(signature.args[i])(context, builder, args[i])
                width = builder.extract_value(arr.shape, 1)
                return builder.gep(arr.data, [builder.mul(n_v, width)])

            qptr, dptr, mptr = row(0), row(1), row(2)
            xptr = context.make_array(signature.args[4])(context, builder, args[4]).data
            start_v = context.cast(builder, args[5], signature.args[5], types.intp)
            k_v = context.cast(builder, args[6], signature.args[6], types.intp)
            intp = start_v.type

            def const(v):
                return ir.Constant(intp, v)

            vf = ir.VectorType(ir.FloatType(), _LANES)
            vi8, vi32 = ir.VectorType(ir.IntType(8), _LANES), ir.VectorType(ir.IntType(32), _LANES)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]),
                                                 f"llvm.fma.v{_LANES}f32")
            # Hint the lines of the weight row _PREFETCH_ROWS ahead (its quants, scales and mins) into the
            # cache while this one is computed; a prefetch past the end of an array never faults.
            byte_ptr = ir.IntType(8).as_pointer()
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr] + [ir.IntType(32)] * 3), "llvm.prefetch.p0i8")
            read_keep = [ir.Constant(ir.IntType(32), v) for v in (0, 3, 1)]  # read, keep in all levels, data
            q_bytes = k_v if kind == "q8" else builder.sdiv(k_v, const(2))
            f_bytes = builder.mul(builder.sdiv(k_v, const(BLOCK)), const(4))
            for base, nbytes in ((qptr, q_bytes), (dptr, f_bytes)) + (((mptr, f_bytes),) if kind == "q4" else ()):
                ahead = builder.gep(builder.bitcast(base, byte_ptr),
                                    [builder.mul(nbytes, const(_PREFETCH_ROWS))])
                with cgutils.for_range(builder, builder.sdiv(builder.add(nbytes, const(63)), const(64)),
                                       intp=intp) as line:
                    builder.call(prefetch, [builder.gep(ahead, [builder.mul(line.index, const(64))])] + read_keep)
            permute = None
            if kind == "q4" and AVX512:
                permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vi32]),
                                                         "llvm.x86.avx512.permvar.sf.512")

            def load_bytes(offset):
                return builder.load(builder.bitcast(builder.gep(qptr, [offset]), vi8.as_pointer()), align=1)

            def load_x(offset):
                return builder.load(builder.bitcast(builder.gep(xptr, [offset]), vf.as_pointer()), align=4)

            # two accumulators per row (the block's first and second 16 weights): two independent FMA chains
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * _LANES)) for _ in range(2)]
                    for _ in range(rows)]
            with cgutils.for_range(builder, builder.sdiv(k_v, const(BLOCK)), intp=intp) as loop:
                b = loop.index
                d = splat(builder, builder.load(builder.gep(dptr, [b])), vf)
                if kind == "q4":  # 16 bytes: weights 0-15 in the low nibbles, 16-31 in the high ones
                    m = splat(builder, builder.load(builder.gep(mptr, [b])), vf)
                    wide = builder.zext(load_bytes(builder.mul(b, const(BLOCK // 2))), vi32)
                    high = builder.lshr(wide, ir.Constant(vi32, [4] * _LANES))
                    if permute is not None:  # the block's 16 possible weights d q + m, looked up by nibble
                        table = builder.call(fma, [d, ir.Constant(vf, [float(i) for i in range(16)]), m])
                        first = builder.call(permute, [table, wide])  # vpermps reads the low 4 bits
                        second = builder.call(permute, [table, high])
                    else:
                        low = builder.and_(wide, ir.Constant(vi32, [15] * _LANES))
                        first = builder.call(fma, [d, builder.sitofp(low, vf), m])
                        second = builder.call(fma, [d, builder.sitofp(high, vf), m])
                else:  # 32 signed bytes
                    at = builder.mul(b, const(BLOCK))
                    first, second = (builder.fmul(d, builder.sitofp(builder.sext(load_bytes(offset), vi32), vf))
                                     for offset in (at, builder.add(at, const(_LANES))))
                x_at = builder.add(start_v, builder.mul(b, const(BLOCK)))
                for j in range(rows):
                    at = builder.add(x_at, builder.mul(k_v, const(j)))
                    halves = ((accs[j][0], first, at), (accs[j][1], second, builder.add(at, const(_LANES))))
                    for acc, w, x_off in halves:
                        builder.store(builder.call(fma, [w, load_x(x_off), builder.load(acc)]), acc)
            first = ir.Constant(ir.IntType(32), 0)
            sums = [builder.extract_element(lane_sums(builder, [builder.fadd(builder.load(a), builder.load(c))]), first)
                    for a, c in accs]
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen

    return dot


_DOT_BIG, _DOT2, _DOT1 = (_block_dot(r) for r in (_BIG_ROWS, 2, 1))


@numba.njit(**JIT)
def _columns(x, qs, scales, mins, out, n0, n1):
    """out[:, n0:n1] = x @ dequantize(weight rows n0 .. n1-1).T."""
    m, k = x.shape
    flat = x.reshape(m * k)
    for n in range(n0, n1):
        r = 0
        while r + _BIG_ROWS <= m:
            a = _DOT_BIG(qs, scales, mins, n, flat, r * k, k)
            for j in range(_BIG_ROWS):
                out[r + j, n] = a[j]
            r += _BIG_ROWS
        if r + 2 <= m:
            a = _DOT2(qs, scales, mins, n, flat, r * k, k)
            for j in range(2):
                out[r + j, n] = a[j]
            r += 2
        if r < m:
            out[r, n] = _DOT1(qs, scales, mins, n, flat, r * k, k)[0]


# The launch.py items: output columns [span item, span (item + 1)) of linear, one item a thread (numba's
# prange hands each thread a contiguous run, as it did the columns themselves); words: x, qs, scales, mins,
# out, span, the address of _columns for these types (_addresses). _columns is called, not inlined: inlined
# into arrays rebuilt from words, LLVM made its loop 3-7% slower (2026-12-06, Zen 4).


@numba.njit(**JIT)
def _q4_columns(item, words):
    out, span = array2(words, 12, np.float32), words[15]
    n0 = item * span
    call_compiled(words[16], (array2(words, 0, np.float32), array2(words, 3, np.uint8), array2(words, 6, np.float32),
                              array2(words, 9, np.float32), out, n0, min(n0 + span, out.shape[1])))


@numba.njit(**JIT)
def _q8_columns(item, words):
    out, span = array2(words, 12, np.float32), words[15]
    n0 = item * span
    call_compiled(words[16], (array2(words, 0, np.float32), array2(words, 3, np.int8), array2(words, 6, np.float32),
                              array2(words, 9, np.float32), out, n0, min(n0 + span, out.shape[1])))


@functools.lru_cache(maxsize=None)
def _addresses(qs_dtype: type) -> tuple[int, int]:
    """The machine code of the item for weights of qs_dtype, and of _columns for the types it passes."""
    f32 = np.zeros((1, 1), np.float32)
    kernel = native_address(_columns, (f32, np.zeros((1, 1), qs_dtype), f32, f32, f32, 0, 0))
    return item_address(_q4_columns if qs_dtype is np.uint8 else _q8_columns), kernel


def _matmul(x, qs, scales, mins, out):
    """out = x @ dequantize(qs, scales, mins).T over numba's threads, which it sets (blocks_linear's kernel)."""
    item, kernel = _addresses(qs.dtype.type)
    columns = out.shape[1]
    span = max(16, -(-columns // apply_threads(parallel=True)))
    run_parts(item, -(-columns // span), (x, qs, scales, mins, out, span, kernel))


def linear(x: np.ndarray, w: QuantWeight, bias: np.ndarray | None = None) -> np.ndarray:
    """x [T, in] @ dequantize(w).T (+ bias) -> [T, out] float32, reading the blocks (quant.linear is the
    reference). Any number of rows works; numba_ops.linear sends only up to QUANT_MAX_ROWS here. With
    PAGEDSERVE_CPU_ACT_QUANT=q8 (quant_int8.ACT_QUANT) the activations are quantized to 8 bits per block and
    multiplied with integer dot products instead (quant_int8.py; opt-in: it changes results)."""
    return blocks_linear(quant_int8.blocks_kernel if quant_int8.ACT_QUANT == "q8" else _matmul, x, w, bias)


def blocks_linear(kernel, x: np.ndarray, w: QuantWeight, bias: np.ndarray | None = None) -> np.ndarray:
    """x [T, in] @ w.T (+ bias) through `kernel(x, qs, scales, mins_or_scales, out)`, which sets numba's threads
    itself: this file's _matmul or quant_int8.blocks_kernel (the same arguments)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out_features, in_features = w.shape
    if x.ndim != 2 or x.shape[1] != in_features:
        raise ValueError(f"quantized linear: input of shape {x.shape} for a weight of [out, in] = {w.shape}")
    out = np.empty((x.shape[0], out_features), dtype=np.float32)
    if x.shape[0]:
        kernel(x, w.qs, w.scales, w.scales if w.mins is None else w.mins, out)
    if bias is not None:
        out += bias
    return out


def warm_up() -> None:
    """Compile both kernels for the types the model passes: read-only weights (quant.make_quant_weight)."""
    from ..reference.quant import make_quant_weight

    x = np.ones((5, BLOCK), dtype=np.float32)
    q4 = make_quant_weight("q4", np.zeros((2, BLOCK // 2), np.uint8), np.ones((2, 1), np.float32),
                           np.zeros((2, 1), np.float32))
    q8 = make_quant_weight("q8", np.zeros((2, BLOCK), np.int8), np.ones((2, 1), np.float32), None)
    linear(x, q4)
    linear(x, q8)
    if quant_int8.ACT_QUANT:
        quant_int8.warm_up()
