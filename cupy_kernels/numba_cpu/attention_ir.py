"""The two inner loops of the numba attention loop nest (numba_attention.py), written as LLVM vector IR:
a run of RUN dot products (scores) and a run of RUN scaled rows added to an accumulator (P . V).

As numba loops they ran at 15 and 9 GMAC/s on one thread of the Emerald Rapids VM (cache-resident data):
LLVM's Intel tuning vectorised at 256 bits, every dot product ended in its own horizontal sum, and the
accumulate loop was versioned behind run-time checks that the accumulator might alias the cache. Here a
key's dot product is a chain of FMAs over LANES-float pieces of head_dim; the RUN partial vectors are
summed together by a transpose tree (each level pairs the vectors up and halves the lanes per key: 7
shuffle pairs for 8 keys instead of 8 horizontal sums); the accumulate is loads, FMAs and one store per
piece. Same data, same thread: 26 and 18 GMAC/s. Whole kernel, 64 sequences x 192 tokens decoding (one
layer, a pool far larger than the cache): 1 thread 1.59 -> 1.46 ms, 2 threads 1.22 -> 1.06; 256 sequences,
2 threads, 4.82 -> 4.14 ms (medians of 15 interleaved rounds).

The arrays come in as addresses (`address`, taken once per call of the loop nest's helpers): an array
passed to an intrinsic inside the loop nest was reference-counted at each call, two atomic operations
that took 30% of the kernel's time.

A row's rounding depends only on the compiled code, the same for every row, call and thread: a dot
product sums its pieces in order (one FMA each), then the lanes in the tree's order; an accumulate adds the
RUN products, written ((p0 v0 + p1 v1) + (p2 v2 + p3 v3)) + ((p4 v4 + p5 v5) + (p6 v6 + p7 v7)), to acc
(numba's fastmath flags, which the attention kernels compile with, let LLVM reorder that sum once, at
compile time).
LANES is 16 with AVX-512 (one register) and 8 without (8 keys' 16-lane sums, two registers each, would
take all 16 of AVX2's). Both need head_dim to be a multiple of LANES; the loop nest goes key by key
otherwise. The loop nest's prefetch hints take the pool by `address` too.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .gemm import AVX512
from .vector_ir import lane_sums, splat

LANES = 16 if AVX512 else 8  # float32 lanes per vector piece of head_dim
RUN = 8  # keys per call (numba_attention.RUN)


@intrinsic
def address(typingctx, arr):
    """The address of a C-contiguous float32 array's first element, as an integer (for dot_run and axpy_run:
    an array passed to an intrinsic inside the loop nest is reference-counted at each call). A 16-bit KV cache's
    too (as uint16: bfloat16's or float16's bits; numba has no float16 on the CPU), and an 8-bit one's (as int8:
    int8 values or fp8 bits, each row's float32 scale after its values), for the reduced runs below."""
    if not (isinstance(arr, types.Array) and arr.dtype in (types.float32, types.uint16, types.int8)
            and arr.layout == "C"):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, context.get_value_type(types.intp))

    return types.intp(arr), codegen


def _run(body, b_bits: int = 32):
    """An intrinsic f(a, a_at, b, b_at, stride, head_dim, c, c_at) -> None over three float32 arrays given as
    addresses (`address`) and flat offsets into them: `body(builder, a, b, c, stride, head_dim)` emits the
    loop, given pointers to a[a_at], b[b_at] and c[c_at] and intp values. b_bits 16 or 8: b is a 16- or 8-bit KV
    cache (an i16 or i8 pointer, offsets in its elements)."""

    @intrinsic
    def run(typingctx, a, a_at, b, b_at, stride, head_dim, c, c_at):
        if not all(isinstance(v, types.Integer) for v in (a, a_at, b, b_at, stride, head_dim, c, c_at)):
            return None

        def codegen(context, builder, signature, args):
            ints = [context.cast(builder, v, t, types.intp) for v, t in zip(args, signature.args)]
            f32p = ir.FloatType().as_pointer()
            b_p = f32p if b_bits == 32 else ir.IntType(b_bits).as_pointer()
            a_ptr, b_ptr, c_ptr = (builder.gep(builder.inttoptr(ints[i], b_p if i == 2 else f32p), [ints[i + 1]])
                                   for i in (0, 2, 6))
            body(builder, a_ptr, b_ptr, c_ptr, ints[4], ints[5])
            return context.get_dummy_value()

        return types.none(a, a_at, b, b_at, stride, head_dim, c, c_at), codegen

    return run


def _vector_ops(builder):
    """(the LANES-float vector type, llvm.fma on it, a function giving a vector pointer at ptr + offset)."""
    vf = ir.VectorType(ir.FloatType(), LANES)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{LANES}f32")

    def at(ptr, offset):
        return builder.bitcast(builder.gep(ptr, [offset]), vf.as_pointer())

    return vf, fma, at


def _loader(builder, kind: str):
    """A function loading LANES KV values at ptr + offset as a float32 vector: "float32" a plain load; "bfloat16"
    LANES i16 zero-extended and shifted to the high half of i32 lanes (a bfloat16 is a float32's high 16 bits:
    exact); "float16" LANES halves widened (VCVTPH2PS with F16C); the 8-bit kinds LANES bytes (SCALED_KINDS:
    fp8_to_float32 below; int8 a signed conversion), the row's scale applied by the caller. The conversion runs
    in registers inside the loop, on the values as they are loaded: no dequantized copy of the cache."""
    vf, _, at = _vector_ops(builder)
    if kind == "float32":
        return lambda ptr, offset: builder.load(at(ptr, offset), align=4)
    if kind in SCALED_KINDS:
        i8v = ir.VectorType(ir.IntType(8), LANES)

        def load8(ptr, offset):
            raw = builder.load(builder.bitcast(builder.gep(ptr, [offset]), i8v.as_pointer()), align=1)
            return builder.sitofp(raw, vf) if kind == "int8" else fp8_to_float32(builder, raw, kind)

        return load8
    i16v = ir.VectorType(ir.IntType(16), LANES)

    def load(ptr, offset):
        raw = builder.load(builder.bitcast(builder.gep(ptr, [offset]), i16v.as_pointer()), align=2)
        if kind == "bfloat16":
            wide = builder.zext(raw, ir.VectorType(ir.IntType(32), LANES))
            return builder.bitcast(builder.shl(wide, ir.Constant(wide.type, [16] * LANES)), vf)
        return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), LANES)), vf)

    return load


# The 8-bit kinds: rows of int8 values or fp8 bits, each followed by its float32 scale (kv_layout.py).
SCALED_KINDS = ("int8", "fp8_e4m3", "fp8_e5m2")
# The flags of a decoded value's product with its scale: numba's fast-math pass gives reassoc and contract to every
# float operation that has no flags (so that LLVM could fold the scale into the dot product's or the weight's
# multiply); "arcp" concerns division only and keeps them off, so the product is the decoded value, rounded once.
_EXACT = ("arcp",)
# (mantissa bits, exponent bias) of the fp8 formats
_FP8 = {"fp8_e4m3": (3, 7), "fp8_e5m2": (2, 15)}


def fp8_to_float32(builder, raw, kind: str):
    """fp8 bits (an i8 value or vector) as float32, exactly (ml_dtypes' values) by integer ops, with no libcall and
    no float16 on any code path: the magnitude's exponent and mantissa shifted into a float32's and the exponent
    rebiased; a subnormal (exponent 0) is its mantissa times the smallest subnormal; e4m3fn's 0x7F is a NaN (it
    has no infinities), e5m2's exponent 31 an infinity or a NaN, as binary16's; then the sign bit."""
    mant, bias = _FP8[kind]
    n = raw.type.count if isinstance(raw.type, ir.VectorType) else None
    i32 = ir.VectorType(ir.IntType(32), n) if n else ir.IntType(32)
    f32 = ir.VectorType(ir.FloatType(), n) if n else ir.FloatType()

    def c(value, t=i32):
        return ir.Constant(t, [value] * n) if n else ir.Constant(t, value)

    w = builder.zext(raw, i32)
    m = builder.and_(w, c(0x7F))
    sign = builder.shl(builder.and_(w, c(0x80)), c(24))
    normal = builder.bitcast(builder.add(builder.shl(m, c(23 - mant)), c((127 - bias) << 23)), f32)
    sub = builder.fmul(builder.uitofp(m, f32), c(2.0 ** (1 - bias - mant), f32))
    value = builder.bitcast(builder.select(builder.icmp_unsigned("<", m, c(1 << mant)), sub, normal), i32)
    if kind == "fp8_e4m3":
        value = builder.select(builder.icmp_unsigned("==", m, c(0x7F)), c(0x7FC00000), value)
    else:
        top = builder.or_(c(0x7F800000), builder.shl(builder.and_(m, c(3)), c(21)))
        value = builder.select(builder.icmp_unsigned(">=", m, c(0x7C)), top, value)
    return builder.bitcast(builder.or_(value, sign), f32)


def _row_scales(builder, ptr, offsets, head_dim):
    """The splatted float32 scales of the 8-bit rows at ptr + each offset (stored after their head_dim values)."""
    vf = ir.VectorType(ir.FloatType(), LANES)
    return [splat(builder, builder.load(builder.bitcast(builder.gep(ptr, [builder.add(o, head_dim)]),
                                                        ir.FloatType().as_pointer()), align=1), vf)
            for o in offsets]


def _dot_body(builder, q, k, s, stride, head_dim, kind="float32"):
    """s[i] = sum_d q[d] * k[i stride + d] for i < RUN."""
    vf, fma, at = _vector_ops(builder)
    load_k = _loader(builder, kind)
    intp = stride.type
    accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * LANES)) for _ in range(RUN)]
    key_offsets = [builder.mul(stride, ir.Constant(intp, i)) for i in range(RUN)]
    scales = _row_scales(builder, k, key_offsets, head_dim) if kind in SCALED_KINDS else [None] * RUN
    with cgutils.for_range(builder, builder.sdiv(head_dim, ir.Constant(intp, LANES)), intp=intp) as loop:
        c = builder.mul(loop.index, ir.Constant(intp, LANES))
        qv = builder.load(at(q, c), align=4)
        for acc, ko, sc in zip(accs, key_offsets, scales):
            key = load_k(k, builder.add(ko, c))
            key = key if sc is None else builder.fmul(key, sc, flags=_EXACT)  # the stored value times its scale
            builder.store(builder.call(fma, [qv, key, builder.load(acc)]), acc)
    sums = lane_sums(builder, [builder.load(a) for a in accs])
    builder.store(sums, builder.bitcast(s, sums.type.as_pointer()), align=4)


def _axpy_body(builder, p, v, acc, stride, head_dim, kind="float32"):
    """acc[d] += sum_i p[i] v[i stride + d] over d < head_dim, the RUN terms as
    ((p0 v0 + p1 v1) + (p2 v2 + p3 v3)) + ((p4 v4 + p5 v5) + (p6 v6 + p7 v7))."""
    vf, fma, at = _vector_ops(builder)
    load_v = _loader(builder, kind)
    intp = stride.type
    ps = [splat(builder, builder.load(builder.gep(p, [ir.Constant(intp, i)])), vf) for i in range(RUN)]
    row_offsets = [builder.mul(stride, ir.Constant(intp, i)) for i in range(RUN)]
    scales = _row_scales(builder, v, row_offsets, head_dim) if kind in SCALED_KINDS else [None] * RUN
    with cgutils.for_range(builder, builder.sdiv(head_dim, ir.Constant(intp, LANES)), intp=intp) as loop:
        c = builder.mul(loop.index, ir.Constant(intp, LANES))
        rows = [load_v(v, builder.add(o, c)) for o in row_offsets]
        rows = [r if sc is None else builder.fmul(r, sc, flags=_EXACT) for r, sc in zip(rows, scales)]
        pairs = [builder.call(fma, [ps[i + 1], rows[i + 1], builder.fmul(ps[i], rows[i])]) for i in range(0, RUN, 2)]
        total = builder.fadd(builder.fadd(pairs[0], pairs[1]), builder.fadd(pairs[2], pairs[3]))
        out = at(acc, c)
        builder.store(builder.fadd(builder.load(out, align=4), total), out, align=4)


# dot_run(q, q_at, k, k_at, stride, head_dim, s, s_at): s[s_at + i] = sum_d q[q_at + d] * k[k_at + i stride + d]
# for i < RUN. axpy_run(p, p_at, v, v_at, stride, head_dim, acc, acc_at): acc[acc_at + d] += sum_i p[p_at + i]
# v[v_at + i stride + d] for d < head_dim. Arrays as addresses, offsets in floats; head_dim a multiple of LANES.
dot_run = _run(_dot_body)
axpy_run = _run(_axpy_body)
# The same over a 16-bit KV cache (k, v as addresses of uint16 or float16 arrays, offsets in their elements),
# converting each loaded vector to float32 (_loader): attention16.py's loop nest.
dot_run_bf16 = _run(lambda *a: _dot_body(*a, kind="bfloat16"), 16)
axpy_run_bf16 = _run(lambda *a: _axpy_body(*a, kind="bfloat16"), 16)
dot_run_f16 = _run(lambda *a: _dot_body(*a, kind="float16"), 16)
axpy_run_f16 = _run(lambda *a: _axpy_body(*a, kind="float16"), 16)
# And over an 8-bit one (attention8.py; int8 arrays, offsets and stride in bytes: a row is head_dim values and
# its scale's 4 bytes), each value times its row's scale as it is loaded (the decoded value, kv_convert.decode).
SCALED_RUNS = {kind: (_run(lambda *a, kind=kind: _dot_body(*a, kind=kind), 8),
                      _run(lambda *a, kind=kind: _axpy_body(*a, kind=kind), 8)) for kind in SCALED_KINDS}


def _scalar(kind: str):
    """An intrinsic f(bits: uint16) -> float32: one 16-bit KV value (the loop nest's key-by-key tail)."""

    @intrinsic
    def to_float32(typingctx, bits):
        if bits != types.uint16:
            return None

        def codegen(context, builder, signature, args):
            if kind == "bfloat16":
                wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
                return builder.bitcast(wide, ir.FloatType())
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

        return types.float32(bits), codegen

    return to_float32


bf16_to_float32 = _scalar("bfloat16")
f16_to_float32 = _scalar("float16")


def _scalar8(kind: str):
    """An intrinsic f(bits: int8, scale: float32) -> float32: one 8-bit KV value times its row's scale (the loop
    nest's key-by-key tail). The product is made here, without numba's fast-math flags, so that LLVM cannot
    reassociate it into the dot product (q * (k * s) must stay the decoded value's product, not (q * k) * s)."""

    @intrinsic
    def to_float32(typingctx, bits, scale):
        if bits != types.int8 or scale != types.float32:
            return None

        def codegen(context, builder, signature, args):
            value = (builder.sitofp(args[0], ir.FloatType()) if kind == "int8"
                     else fp8_to_float32(builder, args[0], kind))
            return builder.fmul(value, args[1], flags=_EXACT)

        return types.float32(bits, scale), codegen

    return to_float32


SCALED_TO_FLOAT32 = {kind: _scalar8(kind) for kind in SCALED_KINDS}


@intrinsic
def scale_at(typingctx, addr, offset):
    """The float32 stored at byte `offset` from the address `addr` (an 8-bit row's scale)."""
    if not (isinstance(addr, types.Integer) and isinstance(offset, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        a, o = (context.cast(builder, v, t, types.intp) for v, t in zip(args, signature.args))
        ptr = builder.gep(builder.inttoptr(a, ir.IntType(8).as_pointer()), [o])
        return builder.load(builder.bitcast(ptr, ir.FloatType().as_pointer()), align=1)

    return types.float32(addr, offset), codegen
