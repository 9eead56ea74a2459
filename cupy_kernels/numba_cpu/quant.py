"""A numba matmul over GGUF blocks (quant.py) for the few-row matmuls of decode steps.

A decode step with few sequences multiplies a handful of activation rows by every weight of the model, so
it is bound by streaming the weights from memory: 540 MB of float32 per step for SmolLM2-135M, against
96 MB as the file stores them (Q4_1 layers, Q8_0 embedding). This kernel reads the blocks: per block of 32
weights one 16-byte (Q4) or 32-byte (Q8) load, the quants widened to float32 in vector registers, and the
activations of every row of the call (up to _TILE) multiplied against them before the next block is loaded:
a verify step of 1 + k rows reads and unpacks each weight once, as a decode step does.

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
# 6 rows 20.6 vs 25.3, 8 rows 23.8 vs 22.5, 10 rows 34.5 vs 30.5. Since every row shares one unpacking of
# each block (_TILE; bench/decode_rows.py, one thread's CPU time on the busy Xeon VM): AVX-512 9 rows 25.9
# vs 51.8 ms, AVX2 code 40 vs 57: a verify step of 8 drafts stays here.
QUANT_MAX_ROWS = 9
_LANES = 16  # float32 lanes per accumulator (one AVX-512 register, two AVX2 ones)
# Rows a pass over a weight row multiplies while unpacking its blocks, each keeping two accumulators in
# registers: all of a decode or verify step's rows (1 + up to 8 drafts) on AVX-512, whose 32 registers hold
# 9 rows' 18 (+ the unpacked block and its table). In AVX2 code each accumulator is two of 16 registers:
# 2 rows (8, + the block's 4, its scale and min). With more rows (_BUFFERED) that first pass also stores the
# unpacked weight row into a float32 row in L1, and passes of up to _BUFFER_TILE rows read it (12
# accumulators, a weight vector at a time). 3 rows unpacking in AVX2 code spilled an accumulator to the
# stack every block, and some processes ran them 3-4x slower (bench/decode_rows.py, 3 and 5-9 rows: the
# x loads likely aliasing the spill slot). Every weight is read from memory and unpacked once either way.
_TILE = 9 if AVX512 else 2
_BUFFERED = not AVX512
_BUFFER_TILE = 3
# Weight rows ahead whose blocks each row's pass hints into the cache (llvm.prefetch). The hardware
# prefetcher follows each stream only within a 4 KB page and has three per thread here (quants, scales,
# mins). Medians of 11 rounds interleaved in one process, SmolLM2's 30 layers and its Q8 lm_head, 2
# threads, Emerald Rapids VM: 1 row 6.4-7.9 -> 5.4-7.2 ms and the lm_head 1.9-2.2 -> 1.3-1.6; 4 rows
# 9.8-13.2 -> 9.6-13.7 (unchanged); 2, 6 and 8 rows ahead did about as well as 4 at 1 row.
_PREFETCH_ROWS = 4


def _tile_dot(cases):
    """An intrinsic dot(qs, scales, mins, n, x, r0, k, rows, source, out, buf): out[r0 + j, n] = sum_i w_i *
    x[(r0 + j) k + i] for j < rows, with w weight row n dequantized: block b is d[n, b] q + m[n, b] when `qs`
    is uint8 (q4, two quants a byte), d[n, b] q when it is int8 (q8; `mins` is then not read). qs, scales,
    mins and out 2-D, x and buf 1-D, all C-contiguous float32 but qs; k a multiple of 32. The weights come
    from the blocks (source _BLOCKS), from the blocks and are also stored into buf[:k] (_STORE), or from buf
    (_BUFFER: a row already unpacked there). (rows, source) must be one of `cases`: a loop is compiled for each,
    and a switch picks it. Each row adds its products into its own two accumulators in block order whatever
    the case: a row's result is the same bits in any tile, from blocks or from buf. Rows are reached by
    pointer arithmetic, not as views (numba reference-counts each one)."""

    @intrinsic
    def dot(typingctx, qs, scales, mins, n, x, r0, k, rows, source, out, buf):
        if not isinstance(qs, types.Array) or qs.dtype not in (types.int8, types.uint8):
            return None
        kind = "q8" if qs.dtype == types.int8 else "q4"
        for a, ndim in ((qs, 2), (scales, 2), (mins, 2), (x, 1), (out, 2), (buf, 1)):
            if not (isinstance(a, types.Array) and a.ndim == ndim and a.layout == "C"
                    and (a is qs or a.dtype == types.float32)):
                return None
        if not all(isinstance(v, types.Integer) for v in (n, r0, k, rows, source)):
            return None
        sig = types.void(qs, scales, mins, n, x, r0, k, rows, source, out, buf)

        def codegen(context, builder, signature, args):
            n_v = context.cast(builder, args[3], signature.args[3], types.intp)

            def array(i):
                return context.make_array(signature.args[i])(context, builder, args[i])

            def row(i):  # pointer to row n of 2-D C-contiguous array argument i
                arr = array(i)
                return builder.gep(arr.data, [builder.mul(n_v, builder.extract_value(arr.shape, 1))])

            qptr, dptr, mptr = row(0), row(1), row(2)
            xptr, bptr, optr = array(4).data, array(10).data, array(9).data
            ldo = builder.extract_value(array(9).shape, 1)
            r0_v, k_v, rows_v, source_v = (context.cast(builder, args[i], signature.args[i], types.intp)
                                           for i in (5, 6, 7, 8))
            intp = k_v.type

            def const(v):
                return ir.Constant(intp, v)

            vf = ir.VectorType(ir.FloatType(), _LANES)
            vi8, vi32 = ir.VectorType(ir.IntType(8), _LANES), ir.VectorType(ir.IntType(32), _LANES)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]),
                                                 f"llvm.fma.v{_LANES}f32")
            byte_ptr = ir.IntType(8).as_pointer()
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr] + [ir.IntType(32)] * 3), "llvm.prefetch.p0i8")
            read_keep = [ir.Constant(ir.IntType(32), v) for v in (0, 3, 1)]  # read, keep in all levels, data
            permute = None
            if kind == "q4" and AVX512:
                permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vi32]),
                                                         "llvm.x86.avx512.permvar.sf.512")

            def vec_at(ptr, offset, ty):
                return builder.bitcast(builder.gep(ptr, [offset]), ty.as_pointer())

            def prefetch_ahead():
                # Hint the lines of the weight row _PREFETCH_ROWS ahead (its quants, scales and mins) into the
                # cache while this one is computed; a prefetch past the end of an array never faults.
                q_bytes = k_v if kind == "q8" else builder.sdiv(k_v, const(2))
                f_bytes = builder.mul(builder.sdiv(k_v, const(BLOCK)), const(4))
                for base, nbytes in ((qptr, q_bytes), (dptr, f_bytes)) + (((mptr, f_bytes),) if kind == "q4" else ()):
                    ahead = builder.gep(builder.bitcast(base, byte_ptr), [builder.mul(nbytes, const(_PREFETCH_ROWS))])
                    with cgutils.for_range(builder, builder.sdiv(builder.add(nbytes, const(63)), const(64)),
                                           intp=intp) as line:
                        builder.call(prefetch, [builder.gep(ahead, [builder.mul(line.index, const(64))])] + read_keep)

            def unpack(b):
                """Block b's 32 weights as two 16-lane vectors, from the blocks."""
                d = splat(builder, builder.load(builder.gep(dptr, [b])), vf)
                if kind == "q4":  # 16 bytes: weights 0-15 in the low nibbles, 16-31 in the high ones
                    m = splat(builder, builder.load(builder.gep(mptr, [b])), vf)
                    packed = builder.load(vec_at(qptr, builder.mul(b, const(BLOCK // 2)), vi8), align=1)
                    wide = builder.zext(packed, vi32)
                    high = builder.lshr(wide, ir.Constant(vi32, [4] * _LANES))
                    if permute is not None:  # the block's 16 possible weights d q + m, looked up by nibble
                        table = builder.call(fma, [d, ir.Constant(vf, [float(i) for i in range(16)]), m])
                        return builder.call(permute, [table, wide]), builder.call(permute, [table, high])
                    low = builder.and_(wide, ir.Constant(vi32, [15] * _LANES))
                    return (builder.call(fma, [d, builder.sitofp(low, vf), m]),
                            builder.call(fma, [d, builder.sitofp(high, vf), m]))
                at = builder.mul(b, const(BLOCK))  # 32 signed bytes
                return tuple(builder.fmul(d, builder.sitofp(builder.sext(builder.load(vec_at(qptr, o, vi8), align=1),
                                                                          vi32), vf))
                             for o in (at, builder.add(at, const(_LANES))))

            def case(rows: int, source: int):
                # two accumulators per row (the block's first and second 16 weights): two independent FMA chains
                accs = [[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * _LANES)) for _ in range(2)]
                        for _ in range(rows)]
                starts = [builder.mul(builder.add(r0_v, const(j)), k_v) for j in range(rows)]
                with cgutils.for_range(builder, builder.sdiv(k_v, const(BLOCK)), intp=intp) as loop:
                    at = builder.mul(loop.index, const(BLOCK))
                    halves = (at, builder.add(at, const(_LANES)))
                    if source == _BUFFER:
                        w = [builder.load(vec_at(bptr, h, vf), align=4) for h in halves]
                    else:
                        w = unpack(loop.index)
                        if source == _STORE:
                            for h, v in zip(halves, w):
                                builder.store(v, vec_at(bptr, h, vf), align=4)
                    for j in range(rows):
                        for acc, v, h in zip(accs[j], w, halves):
                            x = builder.load(vec_at(xptr, builder.add(starts[j], h), vf), align=4)
                            builder.store(builder.call(fma, [v, x, builder.load(acc)]), acc)
                first = ir.Constant(ir.IntType(32), 0)
                for j, (a, c) in enumerate(accs):
                    both = builder.fadd(builder.load(a), builder.load(c))
                    total = builder.extract_element(lane_sums(builder, [both]), first)
                    at = builder.add(builder.mul(builder.add(r0_v, const(j)), ldo), n_v)
                    builder.store(total, builder.gep(optr, [at]))

            with builder.if_then(builder.icmp_signed("!=", source_v, const(_BUFFER))):
                prefetch_ahead()  # once, before the switch: not a loop of it in every case
            done = builder.append_basic_block("tile_done")
            switch = builder.switch(builder.add(builder.mul(rows_v, const(4)), source_v), done)
            for rows, source in cases:
                block = builder.append_basic_block(f"tile_{rows}_{source}")
                switch.add_case(const(4 * rows + source), block)
                builder.position_at_end(block)
                case(rows, source)
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return sig, codegen

    return dot


# Where a tile's weights come from (the `source` argument of _DOT).
_BLOCKS, _STORE, _BUFFER = 0, 1, 2
_DOT = _tile_dot([(r, _BLOCKS) for r in range(1, _TILE + 1)]
                 + ([(_TILE, _STORE)] + [(r, _BUFFER) for r in range(1, _BUFFER_TILE + 1)] if _BUFFERED else []))


@numba.njit(**JIT)
def _columns(x, qs, scales, mins, out, n0, n1):
    """out[:, n0:n1] = x @ dequantize(weight rows n0 .. n1-1).T: per weight row, one pass of all its rows when
    they fit a tile (_TILE), else with _BUFFERED a first pass of _TILE rows that unpacks the weight row into a
    float32 row and passes of the rest over that (_BUFFER_TILE rows at most), else passes of at most _TILE
    rows unpacking it each; passes as even as they go."""
    m, k = x.shape
    # x copied to start on a cache line (its rows then do too: k is a multiple of 32 floats), so that no
    # 64-byte load of it straddles two lines: on the Xeon VM, L2-resident weights, 1 row 2.5 -> 2.2 ns a
    # block, 5 rows 6.3 -> 4.9, 9 rows 10.0 -> 7.6 (a 16-byte-aligned x, as numpy's malloc gives, against this).
    raw = np.empty(m * k + 16, dtype=np.float32)
    skip = (-raw.ctypes.data % 64) // 4
    flat = raw[skip:skip + m * k]
    flat[:] = x.reshape(m * k)
    buffered = _BUFFERED and m > _TILE
    first = _TILE if buffered else 0  # rows of the unpacking pass
    tile = _BUFFER_TILE if buffered else _TILE
    passes = -(-(m - first) // tile)
    buf = np.empty(k if buffered else 0, dtype=np.float32)
    for n in range(n0, n1):
        r = 0
        if buffered:
            _DOT(qs, scales, mins, n, flat, 0, k, first, _STORE, out, buf)
            r = first
        for i in range(passes):
            rows = -(-(m - r) // (passes - i))
            _DOT(qs, scales, mins, n, flat, r, k, rows, _BUFFER if buffered else _BLOCKS, out, buf)
            r += rows


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
