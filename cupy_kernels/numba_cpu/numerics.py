"""The float32 numerics the numba kernels share: fast_exp and fast_exp2 (polynomial exponentials, each written
once as LLVM IR that also serves the vector exp_sum / exp2_sum; loops around the scalars vectorise, where
numba's np.exp is a scalar libm call), row_max (a vector max, which numba's loops do not vectorise) and
exp_sum / exp2_sum (a softmax row's exponentials and their sum, in vector lanes). Used by the elementwise
kernels (ops.py), the attention loop nest (attention.py) and the prefill tiles (prefill.py)."""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .vector_ir import lane_sums, rotate_half, splat


def _is_row(row, n) -> bool:
    """The (row, n) arguments of the row intrinsics here: a C-contiguous float32 1-D array and an integer."""
    return (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C" and row.dtype == types.float32
            and isinstance(n, types.Integer))


def _row_data(context, builder, signature, args):
    """LLVM values of a row intrinsic's first two arguments: (a pointer to row[0], n as intp)."""
    data = context.make_array(signature.args[0])(context, builder, args[0]).data
    return data, context.cast(builder, args[1], signature.args[1], types.intp)


_MAX_LANES = 16  # floats per vector in row_max (one AVX-512 register; two AVX2 ones)
_MAX_CHAINS = 4  # independent vector maxima, so the loop is not bound by one compare's latency


@intrinsic
def row_max(typingctx, row, n):
    """max(row[:n]) of a C-contiguous float32 row, n >= 1, in vector lanes. numba's loops do not vectorise
    a float max (LLVM only does for functions marked free of NaNs); _MAX_CHAINS vector maxima take 0.04 ns
    per element on the test machine, a quarter of scalar ones. The result is exact (a max does not round),
    the same whatever the lane split: compare-and-select, as x86's max does."""
    if not _is_row(row, n):
        return None

    def codegen(context, builder, signature, args):
        data, count = _row_data(context, builder, signature, args)
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


_EXP_LANES = 16  # floats per vector in exp_sum (one AVX-512 register; two AVX2 ones: the same bits)


def _ir_consts(ty):
    """A maker of constants of float type `ty`, or of its vector type (every lane)."""
    lanes = ty.count if isinstance(ty, ir.VectorType) else 0
    return lambda v: ir.Constant(ty, [v] * lanes) if lanes else ir.Constant(ty, v)


def _ir_floor(builder, x):
    ty = x.type
    name = f"llvm.floor.v{ty.count}f32" if isinstance(ty, ir.VectorType) else "llvm.floor.f32"
    return builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty]), name), [x])


def _ir_scale_by_pow2(builder, p, n):
    """p * 2^n for float (or float vector) n holding whole numbers in the normal exponent range."""
    i32 = ir.VectorType(ir.IntType(32), p.type.count) if isinstance(p.type, ir.VectorType) else ir.IntType(32)
    c = _ir_consts(i32)
    return builder.fmul(p, builder.bitcast(builder.shl(builder.add(builder.fptosi(n, i32), c(127)), c(23)), p.type))


def _ir_clamp_below(builder, x, low):
    c = _ir_consts(x.type)
    return builder.select(builder.fcmp_ordered(">", x, c(low)), x, c(low))


def _exp_ir(builder, x):
    """LLVM IR of exp(x) (fast_exp's) on a float or a vector of floats, without contraction into FMAs: each
    lane has the scalar's bits."""
    c = _ir_consts(x.type)
    x = _ir_clamp_below(builder, x, -87.0)
    x = builder.select(builder.fcmp_ordered("<", x, c(88.0)), x, c(88.0))
    n = _ir_floor(builder, builder.fadd(builder.fmul(x, c(1.4426950408889634)), c(0.5)))
    r = builder.fsub(builder.fsub(x, builder.fmul(n, c(0.693359375))), builder.fmul(n, c(-2.12194440e-4)))
    p = c(1.9875691500e-4)
    for coef in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = builder.fadd(builder.fmul(p, r), c(coef))
    p = builder.fadd(builder.fadd(builder.fmul(builder.fmul(p, r), r), r), c(1.0))
    return _ir_scale_by_pow2(builder, p, n)


def _exp2_ir(builder, x):
    """LLVM IR of 2^x (fast_exp2's), as _exp_ir."""
    c = _ir_consts(x.type)
    x = _ir_clamp_below(builder, x, -126.0)
    n = _ir_floor(builder, builder.fadd(x, c(0.5)))
    f = builder.fsub(x, n)
    p = c(1.535336188319500e-4)
    for coef in (1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2, 2.402264791363012e-1,
                 6.931472028550421e-1, 1.0):
        p = builder.fadd(builder.fmul(p, f), c(coef))
    return _ir_scale_by_pow2(builder, p, n)


def _scalar_intrinsic(exp_ir, name: str, doc: str):
    """A float32 -> float32 intrinsic of exp_ir (its IR inlined where it is called: LLVM vectorises the caller's
    loop around it, e.g. ops.py's SiLU)."""
    def scalar(typingctx, x):
        if not isinstance(x, types.Float):
            return None

        def codegen(context, builder, signature, args):
            return exp_ir(builder, context.cast(builder, args[0], signature.args[0], types.float32))

        return types.float32(x), codegen

    scalar.__name__ = scalar.__qualname__ = name
    scalar.__doc__ = doc
    return intrinsic(scalar)


fast_exp = _scalar_intrinsic(_exp_ir, "fast_exp", """fast_exp(x): exp(x) in float32 within 2 ulp (Cephes expf:
exp(x) = 2^n * exp(r), |r| <= ln2/2, degree-7 polynomial), in plain IR so LLVM vectorises loops around it
(numba's np.exp is a scalar libm call). Inputs are clamped to [-87, 88]: below, the true value is < 2e-38 and
this returns about that instead of 0 or a denormal; above, float32 overflows anyway and callers here never go
there with a meaningful value (SiLU: g / (1 + huge) = -0 either way).""")
fast_exp2 = _scalar_intrinsic(_exp2_ir, "fast_exp2", """fast_exp2(x): 2^x in float32 within about 1 ulp (Cephes
exp2f: 2^x = 2^n * 2^f, |f| <= 1/2, degree-6 polynomial), for x <= 0 (softmax over scores in log2 units:
prefill.py). Five fewer operations than fast_exp, whose reduction by ln2 this does not need: 0.13 ns per
value on the test machine. Inputs are clamped below at -126 (the true value is then < 1.2e-38, and this
returns about that).""")


def _exp_sum_intrinsic(exp_ir, name: str, doc: str):
    def exp_sum(typingctx, row, n, shift):
        if not (_is_row(row, n) and isinstance(shift, types.Float)):
            return None

        def codegen(context, builder, signature, args):
            data, count = _row_data(context, builder, signature, args)
            m = context.cast(builder, args[2], signature.args[2], types.float32)
            intp = count.type
            vec_t = ir.VectorType(ir.FloatType(), _EXP_LANES)
            m_vec = splat(builder, m, vec_t)

            def const(value):
                return ir.Constant(intp, value)

            acc = cgutils.alloca_once_value(builder, ir.Constant(vec_t, [0.0] * _EXP_LANES))
            n_vec = builder.mul(builder.sdiv(count, const(_EXP_LANES)), const(_EXP_LANES))
            with cgutils.for_range_slice(builder, const(0), n_vec, const(_EXP_LANES), intp=intp) as (i, _):
                ptr = builder.bitcast(builder.gep(data, [i]), vec_t.as_pointer())
                p = exp_ir(builder, builder.fsub(builder.load(ptr, align=4), m_vec))
                builder.store(p, ptr, align=4)
                builder.store(builder.fadd(builder.load(acc), p), acc)
            first = builder.extract_element(lane_sums(builder, [builder.load(acc)]), ir.Constant(ir.IntType(32), 0))
            total = cgutils.alloca_once_value(builder, first)
            with cgutils.for_range_slice(builder, n_vec, count, const(1), intp=intp) as (i, _):
                ptr = builder.gep(data, [i])
                p = exp_ir(builder, builder.fsub(builder.load(ptr), m))
                builder.store(p, ptr)
                builder.store(builder.fadd(builder.load(total), p), total)
            return builder.load(total)

        return types.float32(row, n, shift), codegen

    exp_sum.__name__ = exp_sum.__qualname__ = name
    exp_sum.__doc__ = doc
    return intrinsic(exp_sum)


exp_sum = _exp_sum_intrinsic(_exp_ir, "exp_sum", """exp_sum(row, n, shift): row[:n] = fast_exp(row[:n] - shift) in
place, returning their sum (a softmax's numerators and denominator: attention.py). In vector lanes: numba's
loop of fast_exp with a running sum stayed scalar (a float sum is not reassociated). Each value has fast_exp's
bits; the sum is 16 lane sums in index order, added pairwise (vector_ir.lane_sums), then the last n % 16 values in
order: a fixed order for a given n, whatever the row's batch, its place in memory or the code path (AVX2 splits
each 16-lane operation in two).""")

exp2_sum = _exp_sum_intrinsic(_exp2_ir, "exp2_sum", "exp2_sum(row, n, shift): exp_sum with fast_exp2 "
                              "(prefill.py's scores are in log2 units).")


def _addresses_ok(*args) -> bool:
    """The arguments of the address intrinsics here (rotate, silu_mul, stream_copy): integers (attention_ir.address
    gives an array's; offsets and counts)."""
    return all(isinstance(v, types.Integer) for v in args)


def _intp_args(context, builder, signature, args) -> list:
    """Every argument of an address intrinsic as an intp LLVM value."""
    return [context.cast(builder, a, t, types.intp) for a, t in zip(args, signature.args)]


def _lanes_then_rest(builder, count, emit, lanes: int = 16) -> None:
    """emit(type, i) for i in 0, lanes, ... while a whole vector of `lanes` floats fits in count (type: the
    vector), then for each remaining i one float at a time."""
    intp = count.type
    step = ir.Constant(intp, lanes)
    n_vec = builder.mul(builder.sdiv(count, step), step)
    with cgutils.for_range_slice(builder, ir.Constant(intp, 0), n_vec, step, intp=intp) as (i, _):
        emit(ir.VectorType(ir.FloatType(), lanes), i)
    with cgutils.for_range_slice(builder, n_vec, count, ir.Constant(intp, 1), intp=intp) as (i, _):
        emit(ir.FloatType(), i)


@intrinsic
def rotate(typingctx, src, src_at, cos, sin, cs_at, dst, dst_at, half):
    """rotate(src, src_at, cos, sin, cs_at, dst, dst_at, half): one head rotated ("neox" rotate-half), arrays as
    addresses (attention_ir.address) and float offsets: with x1 = src[src_at + i], x2 = src[src_at + half + i],
    c = cos[cs_at + i], s = sin[cs_at + i] for i < half, dst[dst_at + i] = x1 c - x2 s and
    dst[dst_at + half + i] = x2 c + x1 s: each product and sum rounded (no FMA), ops.apply_rotary's arithmetic,
    in vector lanes (numba's loop over one head's 32 pairs spent more in run-time alias checks than in the
    products), the rest of half one at a time. dst may be src's own row only where it does not overlap."""
    if not _addresses_ok(src, src_at, cos, sin, cs_at, dst, dst_at, half):
        return None

    def codegen(context, builder, signature, args):
        v = _intp_args(context, builder, signature, args)
        f32p = ir.FloatType().as_pointer()
        src_p, cos_p, sin_p, dst_p = (builder.gep(builder.inttoptr(v[i], f32p), [v[j]])
                                      for i, j in ((0, 1), (2, 4), (3, 4), (5, 6)))
        half_v = v[7]

        def load(ptr, at, ty):
            return builder.load(builder.bitcast(builder.gep(ptr, [at]), ty.as_pointer()), align=4)

        def store(value, ptr, at, ty):
            builder.store(value, builder.bitcast(builder.gep(ptr, [at]), ty.as_pointer()), align=4)

        def rot(ty, at):
            x1, x2 = load(src_p, at, ty), load(src_p, builder.add(at, half_v), ty)
            c, s = load(cos_p, at, ty), load(sin_p, at, ty)
            y1, y2 = rotate_half(builder, x1, x2, c, s)
            store(y1, dst_p, at, ty)
            store(y2, dst_p, builder.add(at, half_v), ty)

        _lanes_then_rest(builder, half_v, rot)
        return context.get_dummy_value()

    return types.none(src, src_at, cos, sin, cs_at, dst, dst_at, half), codegen


_ARGMAX_LANES = 16


@intrinsic
def row_argmax(typingctx, row, n):
    """numpy's argmax of a C-contiguous float32 row[:n], n >= 1: the first NaN's index if there is one, else the
    first index of the largest value; in one pass of vector lanes (each lane keeps its best value and index,
    replaced only by a larger value or by the first NaN, so the earliest index wins a tie), then the lanes and
    the last n % 16 values in index order by the same rule. numpy's own argmax runs on one thread."""
    if not _is_row(row, n):
        return None

    def codegen(context, builder, signature, args):
        data, count = _row_data(context, builder, signature, args)
        intp = count.type
        lanes = _ARGMAX_LANES
        vf, vi = ir.VectorType(ir.FloatType(), lanes), ir.VectorType(intp, lanes)

        def better(x, best):  # x replaces best: larger, or the first NaN (i1 or a vector of them)
            first_nan = builder.and_(builder.fcmp_unordered("uno", x, x), builder.fcmp_ordered("ord", best, best))
            return builder.or_(builder.fcmp_ordered(">", x, best), first_nan)

        best_v = cgutils.alloca_once_value(builder, ir.Constant(vf, [float("-inf")] * lanes))
        best_i = cgutils.alloca_once_value(builder, ir.Constant(vi, [0] * lanes))
        step = ir.Constant(intp, lanes)
        n_vec = builder.mul(builder.sdiv(count, step), step)
        with cgutils.for_range_slice(builder, ir.Constant(intp, 0), n_vec, step, intp=intp) as (i, _):
            x = builder.load(builder.bitcast(builder.gep(data, [i]), vf.as_pointer()), align=4)
            idx = builder.add(splat(builder, i, vi), ir.Constant(vi, list(range(lanes))))
            take = better(x, builder.load(best_v))
            builder.store(builder.select(take, x, builder.load(best_v)), best_v)
            builder.store(builder.select(take, idx, builder.load(best_i)), best_i)
        # Lanes in index order: lane k's best index is k mod 16 plus a multiple of 16, so the earliest of equal
        # bests is found by taking lanes by (value, then index): a lane replaces the pick if it is better, or
        # equal (or both NaN) with a smaller index.
        def lane(vec, k):
            return builder.extract_element(builder.load(vec), ir.Constant(ir.IntType(32), k))

        pick_v = cgutils.alloca_once_value(builder, lane(best_v, 0))
        pick_i = cgutils.alloca_once_value(builder, lane(best_i, 0))
        for k in range(1, lanes):
            v, j = lane(best_v, k), lane(best_i, k)
            pv, pi = builder.load(pick_v), builder.load(pick_i)
            same = builder.or_(builder.fcmp_ordered("==", v, pv),
                               builder.and_(builder.fcmp_unordered("uno", v, v), builder.fcmp_unordered("uno", pv, pv)))
            take = builder.or_(better(v, pv), builder.and_(same, builder.icmp_signed("<", j, pi)))
            builder.store(builder.select(take, v, pv), pick_v)
            builder.store(builder.select(take, j, pi), pick_i)
        with cgutils.for_range_slice(builder, n_vec, count, ir.Constant(intp, 1), intp=intp) as (i, _):
            x = builder.load(builder.gep(data, [i]))
            take = better(x, builder.load(pick_v))
            builder.store(builder.select(take, x, builder.load(pick_v)), pick_v)
            builder.store(builder.select(take, i, builder.load(pick_i)), pick_i)
        return builder.load(pick_i)

    return types.intp(row, n), codegen


def silu_mul_ir(builder, g, u):
    """LLVM IR of g / (1 + fast_exp(-g)) * u on floats or float vectors, each operation rounded as written."""
    return builder.fmul(builder.fdiv(g, builder.fadd(_ir_consts(g.type)(1.0), _exp_ir(builder, builder.fneg(g)))), u)


@intrinsic
def silu_mul(typingctx, gate, up, out, n):
    """out[i] = gate[i] / (1 + fast_exp(-gate[i])) * up[i] for i < n (arrays as addresses: attention_ir.address),
    each operation rounded as written (no FMA): ops.py's SiLU-and-mul in 16-lane vectors, the rest one at a time,
    the same bits as numba's loop of fast_exp, which LLVM left to run 1.3-1.4x as long (256 x 1,536: 137 -> 107
    us on 2 threads)."""
    if not _addresses_ok(gate, up, out, n):
        return None

    def codegen(context, builder, signature, args):
        v = _intp_args(context, builder, signature, args)
        f32p = ir.FloatType().as_pointer()
        g_p, u_p, o_p = (builder.inttoptr(v[i], f32p) for i in range(3))

        def one(ty, i):
            def at(ptr):
                return builder.bitcast(builder.gep(ptr, [i]), ty.as_pointer())
            y = silu_mul_ir(builder, builder.load(at(g_p), align=4), builder.load(at(u_p), align=4))
            builder.store(y, at(o_p), align=4)

        _lanes_then_rest(builder, v[3], one)
        return context.get_dummy_value()

    return types.none(gate, up, out, n), codegen


@intrinsic
def stream_copy(typingctx, src, dst, n):
    """stream_copy(src, dst, n): dst[:n] = src[:n] (addresses, attention_ir.address), dst 64-byte aligned and n a
    multiple of 16: 64-byte vector stores marked non-temporal (x86 movntps: the lines go to memory without being
    read first). For KV cache rows written to slots all over a pool far larger than the caches, where a
    regular store waits for its line to be read from memory; callers end the writes with store_fence."""
    if not _addresses_ok(src, dst, n):
        return None

    def codegen(context, builder, signature, args):
        v = _intp_args(context, builder, signature, args)
        intp = v[0].type
        f32p = ir.FloatType().as_pointer()
        s_p, d_p = builder.inttoptr(v[0], f32p), builder.inttoptr(v[1], f32p)
        vec_t = ir.VectorType(ir.FloatType(), 16)
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        step = ir.Constant(intp, 16)
        with cgutils.for_range_slice(builder, ir.Constant(intp, 0), v[2], step, intp=intp) as (i, _):
            x = builder.load(builder.bitcast(builder.gep(s_p, [i]), vec_t.as_pointer()), align=4)
            store = builder.store(x, builder.bitcast(builder.gep(d_p, [i]), vec_t.as_pointer()), align=64)
            store.set_metadata("nontemporal", nontemporal)
        return context.get_dummy_value()

    return types.none(src, dst, n), codegen


@intrinsic
def store_fence(typingctx):
    """A full memory fence (x86 mfence): stream_copy's stores are weakly ordered; after it, every thread sees
    them before anything this thread does next."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen
