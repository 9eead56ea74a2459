"""The few-row matmul over GGUF blocks with 8-bit activations and integer dot products, as llama.cpp does it.

numba_quant.py dequantizes each weight block to float32 in registers and multiplies float32 activations. Here
the activations are quantized first, per block of 32 values, to int8 with a float32 scale (and, for a Q4 weight's
minimum, the block's sum): reference/quant.py's quantize_activations, bit for bit. Then per weight block and
activation row one integer dot product of 32 quants (Q4: the 4-bit values 0-15, unsigned; Q8: int8) with 32
int8 activations gives 8 int32 partial sums, converted to float32 and added with one FMA into the row's
8-lane accumulator, times the block's scale dw da; a Q4 block adds m sa (scalar) apart:

    y[r, n] = sum_b (dw[n, b] da[r, b]) sum_i q[n, b, i] a[r, b, i]  +  sum_b m[n, b] sa[r, b]

The integer dot product, by code path (numba_setup.CODE_PATH and the features numba compiles for):
  AVX-512 VNNI   vpdpbusd (u8 x s8, four products a lane into int32), one instruction per block and row
  AVX2           vpmaddubsw (u8 x s8 pairs into int16) then vpmaddwd by ones (pairs into int32)
  otherwise      widened integer multiplies and adds, LLVM's choice of instructions
Q8 weights are signed: as llama.cpp, |q| is the unsigned operand and the activations take q's sign (vpsignb).
No int16 sum saturates: |q| <= 128 (Q4: 15) and |a| <= 127, so a pair is at most 2 * 128 * 127 < 32767.
Every path adds the same four products into each lane, so the integer sums, and with them the float32 results,
are the same bits on every path; a row's result never depends on the other rows of the call.

What it costs in accuracy: rounding x to 8 bits moves each value by at most da / 2 (reference/quant.py,
act_quant_bound); the float32-activation kernel's results are exact-weight float32 sums. Opt-in, with
PAGEDSERVE_CPU_ACT_QUANT=q8 (numba_quant.linear reads ACT_QUANT at each call).
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .gemm import lane_sums, splat
from .setup import CODE_PATH, JIT, JIT_EXACT, apply_threads, numba
from ..reference.quant import ACT_QMAX, BLOCK, QuantWeight

ACT_QUANT_CHOICES = ("", "q8")


def _act_quant_from_env() -> str:
    value = os.environ.get("PAGEDSERVE_CPU_ACT_QUANT", "").strip().lower()
    if value in ("0", "none", "f32", "float32"):
        value = ""
    if value not in ACT_QUANT_CHOICES:
        raise ValueError(f"PAGEDSERVE_CPU_ACT_QUANT must be 'q8' or unset (float32 activations), got {value!r}")
    return value


# "q8": the few-row matmuls over GGUF blocks quantize their activations to 8 bits (this kernel); "": float32.
ACT_QUANT = _act_quant_from_env()


def _target_features() -> str:
    """The feature string numba's target machine compiles for (numba's codegen, not public; "" if unknown)."""
    try:
        from numba.core.registry import cpu_target

        return str(cpu_target.target_context.codegen()._tm_features)
    except Exception:  # noqa: BLE001 - an unknown layout only loses the fast instructions
        return ""


_FEATURES = set(_target_features().split(","))
# The integer dot product this module emits: "vnni", "avx2" or "generic" (see the module docstring).
DOT_PATH = ("vnni" if {"+avx512vnni", "+avx512vl"} <= _FEATURES and CODE_PATH == "avx512"
            else "avx2" if "+avx2" in _FEATURES and CODE_PATH in ("avx512", "avx2") else "generic")
_ROWS = 4  # activation rows a pass over a weight row (then 2, 1): 4 accumulators of 8 lanes
_PREFETCH_ROWS = 4  # weight rows ahead hinted into the cache (numba_quant.py's measurement)


@numba.njit(**JIT_EXACT)
def _quantize_rows(x, a, da, sa):
    """reference/quant.py's quantize_activations into a, da, sa (every operation in float32)."""
    rows, k = x.shape
    qmax = np.float32(ACT_QMAX)
    half = np.float32(0.5)
    for r in range(rows):
        for b in range(k // BLOCK):
            amax = np.float32(0.0)
            for i in range(b * BLOCK, (b + 1) * BLOCK):
                amax = max(amax, abs(x[r, i]))
            d = amax / qmax
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            total = 0
            for i in range(b * BLOCK, (b + 1) * BLOCK):
                v = x[r, i] * inv
                t = np.trunc(v)
                if abs(v - t) >= half:
                    t += np.float32(1.0) if v > 0 else np.float32(-1.0)
                q = int(min(max(t, -qmax), qmax))
                a[r, i] = q
                total += q
            da[r, b] = d
            sa[r, b] = np.float32(total) * d


def _int_dot(builder, w, a, signed_w: bool):
    """LLVM IR: 32 weight quants w (<32 x i8>; unsigned 0-15 unless signed_w) times 32 int8 activations a ->
    <8 x i32>, lane l = the sum of products 4 l .. 4 l + 3."""
    i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
    v32i8, v16i16, v8i32 = ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, 8)
    module = builder.module
    if signed_w and DOT_PATH != "generic":  # |w| unsigned, a with w's sign: the same products
        absf = cgutils.get_or_insert_function(module, ir.FunctionType(v32i8, [v32i8, ir.IntType(1)]), "llvm.abs.v32i8")
        sign = cgutils.get_or_insert_function(module, ir.FunctionType(v32i8, [v32i8, v32i8]), "llvm.x86.avx2.psign.b")
        a = builder.call(sign, [a, w])
        w = builder.call(absf, [w, ir.Constant(ir.IntType(1), 0)])
    if DOT_PATH == "vnni":
        fn = cgutils.get_or_insert_function(module, ir.FunctionType(v8i32, [v8i32] * 3), "llvm.x86.avx512.vpdpbusd.256")
        zero = ir.Constant(v8i32, [0] * 8)
        return builder.call(fn, [zero, builder.bitcast(w, v8i32), builder.bitcast(a, v8i32)])
    if DOT_PATH == "avx2":
        maddubs = cgutils.get_or_insert_function(module, ir.FunctionType(v16i16, [v32i8, v32i8]),
                                                 "llvm.x86.avx2.pmadd.ub.sw")
        maddwd = cgutils.get_or_insert_function(module, ir.FunctionType(v8i32, [v16i16, v16i16]),
                                                "llvm.x86.avx2.pmadd.wd")
        return builder.call(maddwd, [builder.call(maddubs, [w, a]), ir.Constant(v16i16, [1] * 16)])
    v32i32 = ir.VectorType(i32, 32)
    wide_w = builder.sext(w, v32i32) if signed_w else builder.zext(w, v32i32)
    p = builder.mul(wide_w, builder.sext(a, v32i32))
    for lanes in (16, 8):  # add neighbours: pairs, then pairs of pairs (vpmaddubsw's, then vpmaddwd's order)
        ty = ir.VectorType(i32, lanes)
        even = builder.shuffle_vector(p, p, ir.Constant(ir.VectorType(i32, lanes), list(range(0, 2 * lanes, 2))))
        odd = builder.shuffle_vector(p, p, ir.Constant(ir.VectorType(i32, lanes), list(range(1, 2 * lanes, 2))))
        p = builder.add(even, odd)
        assert p.type == ty
    return p


def _block_dot(rows: int):
    """An intrinsic dot(qs, scales, mins, n, a, da, sa, r0) -> UniTuple(float32, rows): weight row n against
    activation rows r0 .. r0 + rows - 1 of a (int8 [T, k]) with scales da and sums sa ([T, k / 32]). qs uint8
    (Q4: mins read) or int8 (Q8: mins not read); every array 2-D C-contiguous."""

    @intrinsic
    def dot(typingctx, qs, scales, mins, n, a, da, sa, r0):
        if not isinstance(qs, types.Array) or qs.dtype not in (types.int8, types.uint8):
            return None
        q4 = qs.dtype == types.uint8
        for arr in (qs, scales, mins, a, da, sa):
            if not (isinstance(arr, types.Array) and arr.ndim == 2 and arr.layout == "C"):
                return None
        if a.dtype != types.int8 or not all(t.dtype == types.float32 for t in (scales, mins, da, sa)):
            return None
        if not all(isinstance(v, types.Integer) for v in (n, r0)):
            return None
        sig = types.UniTuple(types.float32, rows)(qs, scales, mins, n, a, da, sa, r0)

        def codegen(context, builder, signature, args):
            intp = context.get_value_type(types.intp)

            def const(v):
                return ir.Constant(intp, v)

            def row_ptr(i, row):  # pointer to row `row` of 2-D C-contiguous argument i, and its width
                arr = context.make_array(signature.args[i])(context, builder, args[i])
                width = builder.extract_value(arr.shape, 1)
                return builder.gep(arr.data, [builder.mul(row, width)]), width

            n_v = context.cast(builder, args[3], signature.args[3], types.intp)
            r0_v = context.cast(builder, args[7], signature.args[7], types.intp)
            qptr, qwidth = row_ptr(0, n_v)
            dptr, blocks = row_ptr(1, n_v)
            mptr, _ = row_ptr(2, n_v)
            aptr, k_v = row_ptr(4, r0_v)
            daptr, _ = row_ptr(5, r0_v)
            saptr, _ = row_ptr(6, r0_v)

            i8, i32 = ir.IntType(8), ir.IntType(32)
            f32 = ir.FloatType()
            v16i8, v32i8, v8f = ir.VectorType(i8, 16), ir.VectorType(i8, 32), ir.VectorType(f32, 8)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f, [v8f] * 3), "llvm.fma.v8f32")
            fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
            byte_ptr = i8.as_pointer()
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr] + [i32] * 3), "llvm.prefetch.p0i8")
            read_keep = [ir.Constant(i32, v) for v in (0, 3, 1)]
            f_bytes = builder.mul(blocks, const(4))
            streams = [(qptr, qwidth), (dptr, f_bytes)] + ([(mptr, f_bytes)] if q4 else [])
            for base, nbytes in streams:  # the weight row _PREFETCH_ROWS ahead (numba_quant.py)
                ahead = builder.gep(builder.bitcast(base, byte_ptr), [builder.mul(nbytes, const(_PREFETCH_ROWS))])
                with cgutils.for_range(builder, builder.sdiv(builder.add(nbytes, const(63)), const(64)),
                                       intp=intp) as line:
                    builder.call(prefetch, [builder.gep(ahead, [builder.mul(line.index, const(64))])] + read_keep)

            accs = [cgutils.alloca_once_value(builder, ir.Constant(v8f, [0.0] * 8)) for _ in range(rows)]
            mins_acc = [cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(rows)]
            with cgutils.for_range(builder, blocks, intp=intp) as loop:
                b = loop.index
                dw = builder.load(builder.gep(dptr, [b]))
                if q4:  # 16 bytes: weights 0-15 in the low nibbles, 16-31 in the high ones
                    packed = builder.load(builder.bitcast(builder.gep(qptr, [builder.mul(b, const(BLOCK // 2))]),
                                                          v16i8.as_pointer()), align=1)
                    low = builder.and_(packed, ir.Constant(v16i8, [15] * 16))
                    high = builder.lshr(packed, ir.Constant(v16i8, [4] * 16))
                    w = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(i32, 32), list(range(32))))
                    m = builder.load(builder.gep(mptr, [b]))
                else:
                    w = builder.load(builder.bitcast(builder.gep(qptr, [builder.mul(b, const(BLOCK))]),
                                                     v32i8.as_pointer()), align=1)
                for j in range(rows):
                    row_b = builder.add(builder.mul(blocks, const(j)), b)  # block b of activation row r0 + j
                    at = builder.add(builder.mul(k_v, const(j)), builder.mul(b, const(BLOCK)))
                    av = builder.load(builder.bitcast(builder.gep(aptr, [at]), v32i8.as_pointer()), align=1)
                    isum = builder.sitofp(_int_dot(builder, w, av, not q4), v8f)
                    scale = builder.fmul(dw, builder.load(builder.gep(daptr, [row_b])))
                    builder.store(builder.call(fma, [isum, splat(builder, scale, v8f), builder.load(accs[j])]), accs[j])
                    if q4:
                        s = builder.load(builder.gep(saptr, [row_b]))
                        builder.store(builder.call(fma1, [m, s, builder.load(mins_acc[j])]), mins_acc[j])
            first = ir.Constant(i32, 0)
            sums = [builder.fadd(builder.extract_element(lane_sums(builder, [builder.load(acc)]), first),
                                 builder.load(macc)) for acc, macc in zip(accs, mins_acc)]
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen

    return dot


_DOT4, _DOT2, _DOT1 = (_block_dot(r) for r in (_ROWS, 2, 1))


@numba.njit(parallel=True, **JIT)
def _matmul(x, qs, scales, mins, out):
    m, k = x.shape
    a = np.empty((m, k), dtype=np.int8)
    da = np.empty((m, k // BLOCK), dtype=np.float32)
    sa = np.empty((m, k // BLOCK), dtype=np.float32)
    _quantize_rows(x, a, da, sa)
    for n in numba.prange(scales.shape[0]):
        r = 0
        while r + _ROWS <= m:
            v = _DOT4(qs, scales, mins, n, a, da, sa, r)
            for j in range(_ROWS):
                out[r + j, n] = v[j]
            r += _ROWS
        if r + 2 <= m:
            v = _DOT2(qs, scales, mins, n, a, da, sa, r)
            for j in range(2):
                out[r + j, n] = v[j]
            r += 2
        if r < m:
            out[r, n] = _DOT1(qs, scales, mins, n, a, da, sa, r)[0]


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The compiled activation quantization (reference/quant.py's quantize_activations, bit for bit)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"activations must be [T, k * {BLOCK}], got shape {x.shape}")
    a = np.empty(x.shape, dtype=np.int8)
    da = np.empty((x.shape[0], x.shape[1] // BLOCK), dtype=np.float32)
    sa = np.empty_like(da)
    _quantize_rows(x, a, da, sa)
    return a, da, sa


def linear(x: np.ndarray, w: QuantWeight, bias: np.ndarray | None = None) -> np.ndarray:
    """x [T, in] @ w.T (+ bias) -> [T, out] float32 with x quantized to 8 bits per block (reference/quant.py's
    linear_q8 is the reference)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out_features, in_features = w.shape
    if x.ndim != 2 or x.shape[1] != in_features:
        raise ValueError(f"quantized linear: input of shape {x.shape} for a weight of [out, in] = {w.shape}")
    out = np.empty((x.shape[0], out_features), dtype=np.float32)
    if x.shape[0]:
        apply_threads(parallel=True)
        _matmul(x, w.qs, w.scales, w.scales if w.mins is None else w.mins, out)
    if bias is not None:
        out += bias
    return out


def warm_up() -> None:
    """Compile the kernel for the types the model passes (read-only weights, quant.make_quant_weight)."""
    from ..reference.quant import make_quant_weight

    x = np.ones((7, BLOCK), dtype=np.float32)
    q4 = make_quant_weight("q4", np.zeros((2, BLOCK // 2), np.uint8), np.ones((2, 1), np.float32),
                           np.zeros((2, 1), np.float32))
    q8 = make_quant_weight("q8", np.zeros((2, BLOCK), np.int8), np.ones((2, 1), np.float32), None)
    linear(x, q4)
    linear(x, q8)
