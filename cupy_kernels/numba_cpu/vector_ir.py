"""LLVM IR helpers the numba kernels' intrinsics share (numba_gemm's tiles, numba_quant's and
numba_quant_int8's row totals, attention_ir's runs, numerics' vector functions, gemm_rotary's tiles)."""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils


def splat(builder, value, vec_t):
    """LLVM IR: a vector of vec_t with `value` in every lane (numba_gemm's tiles, numba_quant, numba_attention_ir)."""
    undef = ir.Constant(vec_t, ir.Undefined)
    first = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(first, undef, ir.Constant(ir.VectorType(ir.IntType(32), vec_t.count),
                                                            [0] * vec_t.count))


def lane_sums(builder, vectors):
    """LLVM IR: the lane sums of len(vectors) (a power of two, at most their lane count) equal-width float
    vectors, as one vector with vector k's sum in lane k; a fixed order of additions, so a fixed rounding
    (numba_quant's row totals, numba_attention_ir's dot products). Each level pairs the vectors up and, per
    pair, gathers the first half of every sum's lanes of both into one vector and the second halves into
    another, and adds the two: the lanes per sum and the number of vectors halve. With one vector left, it
    folds into itself until one lane per sum remains (for a single vector: pairwise halving)."""
    i32, lanes = ir.IntType(32), vectors[0].type.count
    sums, width, vecs = 1, lanes, list(vectors)  # each vector holds `sums` sums of `width` lanes, sum-major

    def halves():
        lo = [g * width + i for g in range(sums) for i in range(width // 2)]
        return lo, [i + width // 2 for i in lo]

    while len(vecs) > 1:
        masks = [ir.Constant(ir.VectorType(i32, lanes), m + [lanes + i for i in m]) for m in halves()]
        vecs = [builder.fadd(*(builder.shuffle_vector(a, b, m) for m in masks)) for a, b in zip(vecs[0::2], vecs[1::2])]
        sums, width = sums * 2, width // 2
    vec = vecs[0]
    while width > 1:
        vec = builder.fadd(*(builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(i32, len(m)), m))
                             for m in halves()))
        width //= 2
    assert sums == len(vectors) == vec.type.count
    return vec


def rotate_half(builder, x1, x2, c, s):
    """LLVM IR: the rotary embedding of pairs (x1, x2) by (c, s): (x1 c - x2 s, x2 c + x1 s), each product and sum
    rounded (no FMA): ops.apply_rotary's arithmetic (numerics.rotate, gemm_rotary's tiles)."""
    return (builder.fsub(builder.fmul(x1, c), builder.fmul(x2, s)),
            builder.fadd(builder.fmul(x2, c), builder.fmul(x1, s)))


def prefetch_ir(builder, ptr) -> None:
    """LLVM IR: a hint to load the cache line at pointer `ptr` into L1 (read, keep; it never faults): numba_gemm's
    and gemm_rotary's tiles, prefetch.prefetch."""
    i32, i8p = ir.IntType(32), ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p] + [i32] * 3),
                                        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
