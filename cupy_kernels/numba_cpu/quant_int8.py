"""The few-row matmul over GGUF blocks with 8-bit activations and integer dot products, as llama.cpp does it.

numba_quant.py dequantizes each weight block to float32 in registers and multiplies float32 activations. Here
the activations are quantized first, per block of 32 values, to int8 with a float32 scale (and, for a Q4 weight's
minimum, the block's sum): reference/quant.py's quantize_activations, bit for bit. Then, two weight blocks at a
time, per activation row one integer dot product of 64 quants (Q4: the 4-bit values 0-15, unsigned; Q8: int8)
with 64 int8 activations gives 16 int32 partial sums (8 a block), converted to float32 and added with one FMA
into the row's 16-lane accumulator (lanes 0-7 even blocks, 8-15 odd ones) times the blocks' scales dw da; a Q4
block's m sa goes to a 2-lane accumulator beside it:

    y[r, n] = sum_b (dw[n, b] da[r, b]) sum_i q[n, b, i] a[r, b, i]  +  sum_b m[n, b] sa[r, b]

The integer dot product, by code path (numba_setup.CODE_PATH and the features numba compiles for):
  AVX-512 VNNI   vpdpbusd zmm (u8 x s8, four products a lane into int32): one instruction per two blocks and row
  AVX2           vpmaddubsw (u8 x s8 pairs into int16) then vpmaddwd by ones (pairs into int32), per block
  otherwise      widened integer multiplies and adds, LLVM's choice of instructions (SSE2: pmaddwd)
Q8 weights are signed: as llama.cpp, |q| is the unsigned operand and the activations take q's sign (vpsignb on
AVX2; a masked negation on AVX-512, which has no 512-bit vpsignb).
No int16 sum saturates: |q| <= 128 (Q4: 15) and |a| <= 127, so a pair is at most 2 * 128 * 127 < 32767.
Every path adds the same four products into each lane, so the integer sums, and with them the float32 results,
are the same bits on every path; a row's result never depends on the other rows of the call.

SmolLM2-135M's 30 layers' four matmuls (Q4_1), one thread, medians of 9 interleaved rounds against
numba_quant.py's float32-activation kernel (AMD AVX-512 VNNI VM, load ~5 on 2 cores): 1 row 15.9 -> 12.4 ms,
4 rows 34.8 -> 23.5; the Q8_0 lm_head 2.2 -> 1.5 ms at 1 row (a first version, one block at a time
with 8-lane vpdpbusd: 15.3 ms at 1 row, 29.8 at 4). End to end, one request 32 -> 128 on one thread, the same
loaded VM: 17.2 -> 12.8 ms per output token (medians of 10 alternating runs); AVX2 code 13.4 -> 9.8
(docs/notes/kernels.md).

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

from .vector_ir import lane_sums
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
# Activation rows a pass over a weight row multiplies (a call's rows in passes of at most this, as even as they
# go), each with a 16-lane and a 2-lane accumulator: with AVX-512's 32 registers a decode step's or a verify
# step's 1 + up to 8 rows in one pass, so each weight block is loaded and unpacked once; 4 in AVX2 code
# (16 registers, each accumulator two of them).
_ROWS = 9 if CODE_PATH == "avx512" else 4
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
    """LLVM IR: 64 weight quants w (<64 x i8>: two blocks; unsigned 0-15 unless signed_w) times 64 int8
    activations a -> <16 x i32>, lane l = the sum of products 4 l .. 4 l + 3 (lanes 0-7: the first block)."""
    i1, i8, i16, i32 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32)
    module = builder.module

    def vec(t, n):
        return ir.VectorType(t, n)

    def fn(name, ret, args):
        return cgutils.get_or_insert_function(module, ir.FunctionType(ret, args), name)

    def idx(values):
        return ir.Constant(vec(i32, len(values)), list(values))

    if DOT_PATH == "vnni":
        if signed_w:  # |w| unsigned, a with w's sign: the same products (AVX-512 has no 512-bit vpsignb)
            negative = builder.icmp_signed("<", w, ir.Constant(vec(i8, 64), [0] * 64))
            a = builder.select(negative, builder.sub(ir.Constant(vec(i8, 64), [0] * 64), a), a)
            w = builder.call(fn("llvm.abs.v64i8", vec(i8, 64), [vec(i8, 64), i1]), [w, ir.Constant(i1, 0)])
        dp = fn("llvm.x86.avx512.vpdpbusd.512", vec(i32, 16), [vec(i32, 16)] * 3)
        return builder.call(dp, [ir.Constant(vec(i32, 16), [0] * 16), builder.bitcast(w, vec(i32, 16)),
                                 builder.bitcast(a, vec(i32, 16))])
    if DOT_PATH == "avx2":
        halves = []
        for h in range(2):
            wh = builder.shuffle_vector(w, w, idx(range(32 * h, 32 * h + 32)))
            ah = builder.shuffle_vector(a, a, idx(range(32 * h, 32 * h + 32)))
            if signed_w:
                ah = builder.call(fn("llvm.x86.avx2.psign.b", vec(i8, 32), [vec(i8, 32)] * 2), [ah, wh])
                wh = builder.call(fn("llvm.abs.v32i8", vec(i8, 32), [vec(i8, 32), i1]), [wh, ir.Constant(i1, 0)])
            pairs = builder.call(fn("llvm.x86.avx2.pmadd.ub.sw", vec(i16, 16), [vec(i8, 32)] * 2), [wh, ah])
            halves.append(builder.call(fn("llvm.x86.avx2.pmadd.wd", vec(i32, 8), [vec(i16, 16)] * 2),
                                       [pairs, ir.Constant(vec(i16, 16), [1] * 16)]))
        return builder.shuffle_vector(halves[0], halves[1], idx(range(16)))
    wide_w = builder.sext(w, vec(i32, 64)) if signed_w else builder.zext(w, vec(i32, 64))
    p = builder.mul(wide_w, builder.sext(a, vec(i32, 64)))
    for lanes in (32, 16):  # add neighbours: pairs, then pairs of pairs (vpmaddubsw's, then vpmaddwd's order)
        p = builder.add(builder.shuffle_vector(p, p, idx(range(0, 2 * lanes, 2))),
                        builder.shuffle_vector(p, p, idx(range(1, 2 * lanes, 2))))
    return p


def _block_dot(max_rows: int):
    """An intrinsic dot(qs, scales, mins, n, a, da, sa, r0, rows, out): out[r0 + j, n] = weight row n against
    activation row r0 + j of a (int8 [T, k]) with scales da and sums sa ([T, k / 32]), j < rows <= max_rows
    (a loop compiled for each height, a switch picks it; a row's sums are the same in any). qs uint8
    (Q4: mins read) or int8 (Q8: mins not read); every array 2-D C-contiguous. Blocks go two at a time (a lone
    last block with zeros beside it): one 16-lane accumulator a row, lanes 0-7 for even blocks, 8-15 for odd."""

    @intrinsic
    def dot(typingctx, qs, scales, mins, n, a, da, sa, r0, rows, out):
        if not isinstance(qs, types.Array) or qs.dtype not in (types.int8, types.uint8):
            return None
        q4 = qs.dtype == types.uint8
        for arr in (qs, scales, mins, a, da, sa, out):
            if not (isinstance(arr, types.Array) and arr.ndim == 2 and arr.layout == "C"):
                return None
        if a.dtype != types.int8 or not all(t.dtype == types.float32 for t in (scales, mins, da, sa, out)):
            return None
        if not all(isinstance(v, types.Integer) for v in (n, r0, rows)):
            return None
        sig = types.void(qs, scales, mins, n, a, da, sa, r0, rows, out)

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

            i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()

            def vec(t, count):
                return ir.VectorType(t, count)

            def idx(values):
                return ir.Constant(vec(i32, len(values)), list(values))

            v16f, v8f, v2f = vec(f32, 16), vec(f32, 8), vec(f32, 2)
            fma16 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f] * 3), "llvm.fma.v16f32")
            fma2 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v2f, [v2f] * 3), "llvm.fma.v2f32")
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

            def load(ptr, offset, ty):
                return builder.load(builder.bitcast(builder.gep(ptr, [offset]), ty.as_pointer()), align=1)

            def widen(v, count):  # a vector of `count` lanes, zeros in the lanes past v's
                zero = ir.Constant(v.type, [0] * v.type.count) if isinstance(v.type.element, ir.IntType) \
                    else ir.Constant(v.type, [0.0] * v.type.count)
                return builder.shuffle_vector(v, zero, idx(range(count)))

            def floats(ptr, at, pair):  # blocks at, at + 1 of a float row (or block at and 0.0)
                if pair:
                    return load(ptr, at, v2f)
                return builder.insert_element(ir.Constant(v2f, [0.0, 0.0]), builder.load(builder.gep(ptr, [at])),
                                              ir.Constant(i32, 0))

            out_arr = context.make_array(signature.args[9])(context, builder, args[9])
            optr, ldo = out_arr.data, builder.extract_value(out_arr.shape, 1)

            def case(rows: int):
                accs = [cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16)) for _ in range(rows)]
                mins_acc = [cgutils.alloca_once_value(builder, ir.Constant(v2f, [0.0] * 2)) for _ in range(rows)]

                def blocks_at(b, pair: bool):
                    """Add blocks b and b + 1 (pair) or block b alone to every row's accumulators."""
                    if q4:  # 16 bytes a block: weights 0-15 in the low nibbles, 16-31 in the high ones
                        nbytes = 32 if pair else 16
                        packed = load(qptr, builder.mul(b, const(BLOCK // 2)), vec(i8, nbytes))
                        low = builder.and_(packed, ir.Constant(vec(i8, nbytes), [15] * nbytes))
                        high = builder.lshr(packed, ir.Constant(vec(i8, nbytes), [4] * nbytes))
                        if pair:
                            order = list(range(16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))
                            w = builder.shuffle_vector(low, high, idx(order))
                        else:
                            w = widen(builder.shuffle_vector(low, high, idx(range(32))), 64)
                    else:
                        w = load(qptr, builder.mul(b, const(BLOCK)), vec(i8, 64 if pair else 32))
                        w = w if pair else widen(w, 64)
                    dw = floats(dptr, b, pair)
                    m = floats(mptr, b, pair) if q4 else None
                    for j in range(rows):
                        row_b = builder.add(builder.mul(blocks, const(j)), b)  # block b of activation row r0 + j
                        at = builder.add(builder.mul(k_v, const(j)), builder.mul(b, const(BLOCK)))
                        av = load(aptr, at, vec(i8, 64 if pair else 32))
                        av = av if pair else widen(av, 64)
                        isum = builder.sitofp(_int_dot(builder, w, av, not q4), v16f)
                        scale = builder.shuffle_vector(builder.fmul(dw, floats(daptr, row_b, pair)),
                                                       ir.Constant(v2f, None), idx([0] * 8 + [1] * 8))
                        builder.store(builder.call(fma16, [isum, scale, builder.load(accs[j])]), accs[j])
                        if q4:
                            s = floats(saptr, row_b, pair)
                            builder.store(builder.call(fma2, [m, s, builder.load(mins_acc[j])]), mins_acc[j])

                with cgutils.for_range(builder, builder.sdiv(blocks, const(2)), intp=intp) as loop:
                    blocks_at(builder.mul(loop.index, const(2)), True)
                odd = builder.icmp_signed("!=", builder.srem(blocks, const(2)), const(0))
                with builder.if_then(odd, likely=False):
                    blocks_at(builder.sub(blocks, const(1)), False)
                first, second = ir.Constant(i32, 0), ir.Constant(i32, 1)
                sums = []
                for acc, macc in zip(accs, mins_acc):
                    total = builder.load(acc)
                    even_odd = builder.fadd(builder.shuffle_vector(total, total, idx(range(8))),
                                            builder.shuffle_vector(total, total, idx(range(8, 16))))
                    mv = builder.load(macc)
                    sums.append(builder.fadd(builder.extract_element(lane_sums(builder, [even_odd]), first),
                                             builder.fadd(builder.extract_element(mv, first),
                                                          builder.extract_element(mv, second))))
                assert even_odd.type == v8f
                for j, total in enumerate(sums):
                    at = builder.add(builder.mul(builder.add(r0_v, const(j)), ldo), n_v)
                    builder.store(total, builder.gep(optr, [at]))

            rows_v = context.cast(builder, args[8], signature.args[8], types.intp)
            done = builder.append_basic_block("tile_done")
            switch = builder.switch(rows_v, done)
            for rows in range(1, max_rows + 1):
                block = builder.append_basic_block(f"tile_{rows}")
                switch.add_case(const(rows), block)
                builder.position_at_end(block)
                case(rows)
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return sig, codegen

    return dot


_DOT = _block_dot(_ROWS)


@numba.njit(parallel=True, **JIT)
def _matmul(x, qs, scales, mins, out):
    m, k = x.shape
    a = np.empty((m, k), dtype=np.int8)
    da = np.empty((m, k // BLOCK), dtype=np.float32)
    sa = np.empty((m, k // BLOCK), dtype=np.float32)
    _quantize_rows(x, a, da, sa)
    passes = -(-m // _ROWS)
    for n in numba.prange(scales.shape[0]):
        r = 0
        for i in range(passes):
            rows = -(-(m - r) // (passes - i))
            _DOT(qs, scales, mins, n, a, da, sa, r, rows, out)
            r += rows


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
    from .quant import blocks_linear  # quant.py imports this module

    return blocks_linear(blocks_kernel, x, w, bias)


def blocks_kernel(x, qs, scales, mins, out) -> None:
    """_matmul on numba's threads (quant.blocks_linear's kernel: each kernel sets its own threads)."""
    apply_threads(parallel=True)
    _matmul(x, qs, scales, mins, out)


def warm_up() -> None:
    """Compile the kernel for the types the model passes (read-only weights, quant.make_quant_weight)."""
    from ..reference.quant import make_quant_weight

    x = np.ones((7, BLOCK), dtype=np.float32)
    q4 = make_quant_weight("q4", np.zeros((2, BLOCK // 2), np.uint8), np.ones((2, 1), np.float32),
                           np.zeros((2, 1), np.float32))
    q8 = make_quant_weight("q8", np.zeros((2, BLOCK), np.int8), np.ones((2, 1), np.float32), None)
    linear(x, q4)
    linear(x, q8)
