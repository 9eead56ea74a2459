"""The float32 numerics the numba kernels share: fast_exp and fast_exp2 (polynomial exponentials in plain
arithmetic, so LLVM vectorises them: numba's np.exp is a scalar libm call) and row_max (a vector max, which
numba's loops do not vectorise). Used by the elementwise kernels (ops.py), the attention loop nest
(attention.py) and the prefill tiles (prefill.py)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .setup import JIT_EXACT, numba


@intrinsic
def _f32_from_bits(typingctx, bits):
    """Reinterpret an int32's bits as a float32 (2^n from its exponent field, for fast_exp)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@numba.njit(inline="always", **JIT_EXACT)
def fast_exp(x):
    """exp(x) in float32 within 2 ulp (Cephes expf: exp(x) = 2^n * exp(r), |r| <= ln2/2, degree-7
    polynomial), in plain arithmetic so LLVM vectorises it. Inputs are clamped to [-87, 88]: below, the
    true value is < 2e-38 and this returns about that instead of 0 or a denormal; above, float32 overflows
    anyway and callers here never go there with a meaningful value (SiLU: g / (1 + huge) = -0 either way)."""
    x = x if x > np.float32(-87.0) else np.float32(-87.0)
    x = x if x < np.float32(88.0) else np.float32(88.0)
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)  # ln2 split in two: r exact
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))


@numba.njit(inline="always", **JIT_EXACT)
def fast_exp2(x):
    """2^x in float32 within about 1 ulp (Cephes exp2f: 2^x = 2^n * 2^f, |f| <= 1/2, degree-6 polynomial),
    for x <= 0 (softmax over scores in log2 units: numba_prefill). Five fewer operations than fast_exp,
    whose reduction by ln2 this does not need: 0.13 ns per value on the test machine. Inputs are clamped
    below at -126 (the true value is then < 1.2e-38, and this returns about that)."""
    x = x if x > np.float32(-126.0) else np.float32(-126.0)
    n = np.floor(x + np.float32(0.5))
    f = x - n
    p = np.float32(1.535336188319500e-4)
    p = p * f + np.float32(1.339887440266574e-3)
    p = p * f + np.float32(9.618437357674640e-3)
    p = p * f + np.float32(5.550332471162809e-2)
    p = p * f + np.float32(2.402264791363012e-1)
    p = p * f + np.float32(6.931472028550421e-1)
    p = p * f + np.float32(1.0)
    return p * _f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))


_MAX_LANES = 16  # floats per vector in row_max (one AVX-512 register; two AVX2 ones)
_MAX_CHAINS = 4  # independent vector maxima, so the loop is not bound by one compare's latency


@intrinsic
def row_max(typingctx, row, n):
    """max(row[:n]) of a C-contiguous float32 row, n >= 1, in vector lanes. numba's loops do not vectorise
    a float max (LLVM only does for functions marked free of NaNs); _MAX_CHAINS vector maxima take 0.04 ns
    per element on the test machine, a quarter of scalar ones. The result is exact (a max does not round),
    the same whatever the lane split: compare-and-select, as x86's max does."""
    if not (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C" and row.dtype == types.float32
            and isinstance(n, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        count = context.cast(builder, args[1], signature.args[1], types.intp)
        intp = count.type
        vec_t = ir.VectorType(ir.FloatType(), _MAX_LANES)

        def const(value):
            return ir.Constant(intp, value)

        def larger(a, b):
            return builder.select(builder.fcmp_ordered(">", b, a), b, a)

        def load_vec(i):
            return builder.load(builder.bitcast(builder.gep(data, [i]), vec_t.as_pointer()), align=4)

        chains = [cgutils.alloca_once_value(builder, ir.Constant(vec_t, [float("-inf")] * _MAX_LANES))
                  for _ in range(_MAX_CHAINS)]
        big = _MAX_LANES * _MAX_CHAINS
        n_big = builder.mul(builder.sdiv(count, const(big)), const(big))
        n_vec = builder.mul(builder.sdiv(count, const(_MAX_LANES)), const(_MAX_LANES))
        with cgutils.for_range_slice(builder, const(0), n_big, const(big), intp=intp) as (i, _):
            for c, chain in enumerate(chains):
                builder.store(larger(builder.load(chain), load_vec(builder.add(i, const(c * _MAX_LANES)))), chain)
        with cgutils.for_range_slice(builder, n_big, n_vec, const(_MAX_LANES), intp=intp) as (i, _):
            builder.store(larger(builder.load(chains[0]), load_vec(i)), chains[0])
        vec = builder.load(chains[0])
        for chain in chains[1:]:
            vec = larger(vec, builder.load(chain))
        best = builder.extract_element(vec, ir.Constant(ir.IntType(32), 0))
        for lane in range(1, _MAX_LANES):
            best = larger(best, builder.extract_element(vec, ir.Constant(ir.IntType(32), lane)))
        result = cgutils.alloca_once_value(builder, best)
        with cgutils.for_range_slice(builder, n_vec, count, const(1), intp=intp) as (i, _):
            builder.store(larger(builder.load(result), builder.load(builder.gep(data, [i]))), result)
        return builder.load(result)

    return types.float32(row, n), codegen
