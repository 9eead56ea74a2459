"""A numba matmul over GGUF blocks (quant.py) for the few-row matmuls of decode steps.

A decode step with few sequences multiplies a handful of activation rows by every weight of the model, so
it is bound by streaming the weights from memory: 540 MB of float32 per step for SmolLM2-135M, against
96 MB as the file stores them (Q4_1 layers, Q8_0 embedding). This kernel reads the blocks: per block of 32
weights one 16-byte (Q4) or 32-byte (Q8) load, the quants widened to float32 in vector registers, and the
activations of up to four rows multiplied against them before the next block is loaded.

    y[r, n] = sum_b d[n, b] * (sum_i q[n, b, i] * x[r, 32 b + i])  +  sum_b m[n, b] * xsum[r, b]

with xsum[r, b] the sum of row r's 32 activations of block b (computed once per call). The inner sum
keeps 16 float32 lanes per row across all blocks of a weight row and adds them up once at its end.
numba does not vectorise this loop (the per-block scale breaks its reduction), so the loop body is
written as LLVM vector IR (an @intrinsic, as numba_ops.row_max): 2.5-3.2 ms for the 30 layers' four
matmuls at one row against 10-11 ms reading the float32 weights (OpenBLAS or numba_gemm; quiet 2-core
test VM, 2 threads).

The products are exact (quant.py), so the result is the float32 reference's up to the order of the sums.
Above QUANT_MAX_ROWS rows the packed float32 GEMM (numba_gemm.py) is faster (both are compute-bound
there, and it does fewer operations per product), and numba_ops.linear takes that path.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .numba_gemm import splat
from .numba_setup import JIT, apply_threads, numba
from .quant import BLOCK, QuantWeight

# Rows up to which a quantized weight takes this kernel; above, the packed float32 GEMM (numba_gemm.py) is
# faster. SmolLM2's 30 layers on the test VM, this kernel vs the GEMM (which streams 425 MB, so its few-row
# times follow the host's memory bandwidth): 1 row 4.1 vs 10.0 ms, 4 rows 6.2 vs 9.6, 6 rows 9.0 vs 10.7,
# 8 rows 11.8 vs 9.9, 16 rows 25.1 vs 12.1.
QUANT_MAX_ROWS = 6
_LANES = 16  # float32 lanes per accumulator (one AVX-512 register, two AVX2 ones)
_ROWS = (4, 2, 1)  # rows per pass over a weight row: one intrinsic each


def _lane_sum(builder, vec):
    """The sum of a vector's lanes, halving it pairwise (a fixed order, so a fixed rounding)."""
    i32, n = ir.IntType(32), vec.type.count
    while n > 1:
        half = n // 2
        lo = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(i32, half), list(range(half))))
        hi = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(i32, half), list(range(half, n))))
        vec, n = builder.fadd(lo, hi), half
    return builder.extract_element(vec, ir.Constant(i32, 0))


def _block_dot(kind: str, rows: int):
    """An intrinsic dot(qs_row, scales_row, x_flat, start, k) -> UniTuple(float32, rows): for one weight
    row, sum_b d_b * sum_i q_bi * x[start + j k + 32 b + i] for j < rows (the Q4 mins term is left to the
    caller). `qs_row` int8 (q8) or uint8 (q4), all arrays 1-D C-contiguous, k a multiple of 32."""
    qdtype = types.int8 if kind == "q8" else types.uint8

    @intrinsic
    def dot(typingctx, qs, scales, x, start, k):
        for a, dt in ((qs, qdtype), (scales, types.float32), (x, types.float32)):
            if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == dt):
                return None
        if not (isinstance(start, types.Integer) and isinstance(k, types.Integer)):
            return None
        sig = types.UniTuple(types.float32, rows)(qs, scales, x, start, k)

        def codegen(context, builder, signature, args):
            qptr = context.make_array(signature.args[0])(context, builder, args[0]).data
            dptr = context.make_array(signature.args[1])(context, builder, args[1]).data
            xptr = context.make_array(signature.args[2])(context, builder, args[2]).data
            start_v = context.cast(builder, args[3], signature.args[3], types.intp)
            k_v = context.cast(builder, args[4], signature.args[4], types.intp)
            intp = start_v.type
            vf = ir.VectorType(ir.FloatType(), _LANES)
            vi8, vi32 = ir.VectorType(ir.IntType(8), _LANES), ir.VectorType(ir.IntType(32), _LANES)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]),
                                                 f"llvm.fma.v{_LANES}f32")

            def const(v):
                return ir.Constant(intp, v)

            def load_bytes(offset):
                return builder.load(builder.bitcast(builder.gep(qptr, [offset]), vi8.as_pointer()), align=1)

            def load_x(offset):
                return builder.load(builder.bitcast(builder.gep(xptr, [offset]), vf.as_pointer()), align=4)

            accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * _LANES)) for _ in range(rows)]
            with cgutils.for_range(builder, builder.sdiv(k_v, const(BLOCK)), intp=intp) as loop:
                b = loop.index
                d = splat(builder, builder.load(builder.gep(dptr, [b])), vf)
                if kind == "q4":  # 16 bytes: weights 0-15 in the low nibbles, 16-31 in the high ones
                    wide = builder.zext(load_bytes(builder.mul(b, const(BLOCK // 2))), vi32)
                    first = builder.sitofp(builder.and_(wide, ir.Constant(vi32, [15] * _LANES)), vf)
                    second = builder.sitofp(builder.lshr(wide, ir.Constant(vi32, [4] * _LANES)), vf)
                else:  # 32 signed bytes
                    at = builder.mul(b, const(BLOCK))
                    first = builder.sitofp(builder.sext(load_bytes(at), vi32), vf)
                    second = builder.sitofp(builder.sext(load_bytes(builder.add(at, const(_LANES))), vi32), vf)
                x_at = builder.add(start_v, builder.mul(b, const(BLOCK)))
                for j in range(rows):
                    at = builder.add(x_at, builder.mul(k_v, const(j)))
                    s = builder.fmul(second, load_x(builder.add(at, const(_LANES))))
                    s = builder.call(fma, [first, load_x(at), s])
                    builder.store(builder.call(fma, [d, s, builder.load(accs[j])]), accs[j])
            sums = [_lane_sum(builder, builder.load(a)) for a in accs]
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen

    return dot


_Q4_4, _Q4_2, _Q4_1 = (_block_dot("q4", r) for r in _ROWS)
_Q8_4, _Q8_2, _Q8_1 = (_block_dot("q8", r) for r in _ROWS)


@numba.njit(inline="always", **JIT)
def _mins_term(mins_row, xsum, r):
    s = np.float32(0.0)
    for b in range(mins_row.shape[0]):
        s += mins_row[b] * xsum[r, b]
    return s


@numba.njit(parallel=True, **JIT)
def _q4_matmul(x, xsum, qs, scales, mins, out):
    m, k = x.shape
    flat = x.reshape(m * k)
    for n in numba.prange(scales.shape[0]):
        q, d, mn = qs[n], scales[n], mins[n]
        r = 0
        while r + 4 <= m:
            a = _Q4_4(q, d, flat, r * k, k)
            for j in range(4):
                out[r + j, n] = a[j] + _mins_term(mn, xsum, r + j)
            r += 4
        if r + 2 <= m:
            a = _Q4_2(q, d, flat, r * k, k)
            for j in range(2):
                out[r + j, n] = a[j] + _mins_term(mn, xsum, r + j)
            r += 2
        if r < m:
            out[r, n] = _Q4_1(q, d, flat, r * k, k)[0] + _mins_term(mn, xsum, r)


@numba.njit(parallel=True, **JIT)
def _q8_matmul(x, qs, scales, out):
    m, k = x.shape
    flat = x.reshape(m * k)
    for n in numba.prange(scales.shape[0]):
        q, d = qs[n], scales[n]
        r = 0
        while r + 4 <= m:
            a = _Q8_4(q, d, flat, r * k, k)
            for j in range(4):
                out[r + j, n] = a[j]
            r += 4
        if r + 2 <= m:
            a = _Q8_2(q, d, flat, r * k, k)
            for j in range(2):
                out[r + j, n] = a[j]
            r += 2
        if r < m:
            out[r, n] = _Q8_1(q, d, flat, r * k, k)[0]


def linear(x: np.ndarray, w: QuantWeight, bias: np.ndarray | None = None) -> np.ndarray:
    """x [T, in] @ dequantize(w).T (+ bias) -> [T, out] float32, reading the blocks (quant.linear is the
    reference). Any number of rows works; numba_ops.linear sends only up to QUANT_MAX_ROWS here."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out_features, in_features = w.shape
    if x.ndim != 2 or x.shape[1] != in_features:
        raise ValueError(f"quantized linear: input of shape {x.shape} for a weight of [out, in] = {w.shape}")
    out = np.empty((x.shape[0], out_features), dtype=np.float32)
    if x.shape[0]:
        apply_threads(parallel=True)
        if w.kind == "q4":
            xsum = x.reshape(x.shape[0], -1, BLOCK).sum(axis=2, dtype=np.float32)
            _q4_matmul(x, xsum, w.qs, w.scales, w.mins, out)
        else:
            _q8_matmul(x, w.qs, w.scales, out)
    if bias is not None:
        out += bias
    return out


def warm_up() -> None:
    """Compile both kernels for the types the model passes: read-only weights (quant.make_quant_weight)."""
    from .quant import make_quant_weight

    x = np.ones((5, BLOCK), dtype=np.float32)
    q4 = make_quant_weight("q4", np.zeros((2, BLOCK // 2), np.uint8), np.ones((2, 1), np.float32),
                           np.zeros((2, 1), np.float32))
    q8 = make_quant_weight("q8", np.zeros((2, BLOCK), np.int8), np.ones((2, 1), np.float32), None)
    linear(x, q4)
    linear(x, q8)
