"""The numba set's float32 matmul: weights packed once at load into column panels, a register-tiled kernel.

OpenBLAS packs its operand on every call (a decode step of 64 sequences streams each layer weight, copies it
into its panel format, then multiplies: ~293 GFLOP/s against ~430 for a large sgemm). Here the weight is
stored in that panel format from the start, once:

    panels[p, k, j] = W[32 p + j, k]      W the [out, in] checkpoint weight; [out / 32, in, 32] float32

so a panel (32 output columns, every k) is one contiguous stream. The kernel keeps a 12-row x 32-column
tile of the output in twenty-four 16-lane registers and walks k: two vector loads of the panel, one
broadcast of each of the 12 activation rows, 24 FMAs, a prefetch of the panel 64 rows of k ahead and one of
the tile's share of the next panel (_panel_rows; without AVX-512: 16-column panels and 6-row tiles in 8-lane
registers). Panels are shared out over the threads (a panel a launch.py item); a panel (73 KB for in = 576)
stays in L2 while every tile of a block of activation rows (about half the L2's worth: row_passes) passes over
it, and the block itself stays in L2 while the thread's panels pass over it. Against numpy's OpenBLAS, SmolLM2's
30 layers: 1 row 9.9 vs 11.4 ms, 64 rows 30-33 vs 46, 2,048 rows 900 vs 1,000 (docs/benchmarks.md).

Numerics: each output is one FMA chain over k in order, the same bits whatever the number of rows in the
call, the row's place in its tile, or the thread count (tests/cupy_kernels/test_numba_gemm.py); against
numpy's matmul (the reference, ops.linear) it differs by the order of the sums.

A SiLU-gated MLP's gate_up is packed with gate and up side by side in each panel (pack_gated), so a tile holds
both halves of its outputs and stores silu(gate) * up (matmul_silu_and_mul; numerics.silu_mul_ir, the bits of
ops.silu_and_mul after the plain GEMM): no [T, 2I] temporary written and read back (256 rows: 2,665-2,849 ->
2,543-2,550 us a layer). Likewise matmul_add (mode ADD) adds the tile into what C holds: the decoder layer's
residual add after o_proj and down, with add_rms_norm's one rounding.

Panels and outputs start on a cache line (host.malloc.aligned_empty): on malloc's 16-byte boundaries each
64-byte panel load spanned two lines (2-4% a matmul; docs/notes/kernels.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..host.malloc import aligned_empty, aligned_zeros
from .launch import array1, item_address, run_parts
from .setup import CODE_PATH, JIT_EXACT, apply_threads, call_compiled, l2_bytes, native_address, numba
from .numerics import silu_mul_ir
from .vector_ir import prefetch_ir, splat

# The tile must fit the vector registers: AVX-512 has 32 of 16 floats, an 8 x 32 tile takes 16 (+2 for the
# panel row, +1 broadcast), a 12 x 32 one 24 (_BIG_ROWS). AVX2 has 16 of 8 floats: a 6 x 16 tile (12 + 2
# + 1), as OpenBLAS's Haswell kernel; 8 x 32 there spills and ran at 168 GFLOP/s against 221 for 6 x 16
# (64 rows, AVX2 code on the test VM; OpenBLAS's Haswell kernel 185).
AVX512 = CODE_PATH == "avx512"  # numba_setup.CODE_PATH: what numba emits, not the CPU's name
PANEL = 32 if AVX512 else 16  # output columns per panel: two vector registers per row
_LANES = PANEL // 2
# Rows per pass over a panel, then 8 (AVX-512), 4, 2 and 1 for the rest. 12 rows x 2 vectors = 24
# accumulators of AVX-512's 32 registers (+ 2 panel vectors and a broadcast). Against 8-row tiles on the
# Emerald Rapids VM, SmolLM2's four layer matmuls, 2 threads, medians of 15 interleaved rounds: 64 rows
# 257.6 -> 271.6 GFLOP/s, 256 rows 172.1 -> 183.7, 2,048 rows 109.4 -> 114.6 (a slow phase of the host).
# The same bits: each output is one FMA chain in k order whatever the tile.
_BIG_ROWS = 12 if AVX512 else 6
# Panel rows (k) ahead of the current one to prefetch: 8 KB on AVX-512. SmolLM2's layers at 64 rows
# 33.1 -> 30.1-30.8 ms (32 ahead: 30.7-31.1; 128: 30.7-31.2; 256: 31.1-31.3).
_PREFETCH_K = 64
# Activation rows per pass over the panels: a block of them (120 x 576 floats = 276 KB) stays in L2 while
# every panel of the thread passes over it. Unblocked, 256 rows (590 KB at in = 576) overflow a 512 KB L2
# (AMD Zen 3) and were read again from L3 for every panel: 82-85 GFLOP/s against 164-167 blocked (OpenBLAS
# 150-155; docs/notes/kernels.md). A multiple of both big-tile heights (6, 12): tiles fall where they did,
# and each output's FMA chain is unchanged.
ROW_BLOCK = 120
# Since then the rows per block follow the host's L2 (row_passes): a block of A takes at most half of it, the
# other half for the panels passing over it, within [MIN_ROW_BLOCK, MAX_ROW_BLOCK] rows, and a matmul's rows
# are cut into blocks of about equal size (each starting on a whole big tile). On the Emerald Rapids VM (2 MB
# L2), SmolLM2's four layer matmuls, medians of 7 interleaved rounds, against blocks of ROW_BLOCK: 123 rows +6
# to +10% (the block of 3 rows streamed every weight again for them), 247 rows (bench/jitter.py's steps) +3 to
# +4%, 256 +5%, 512 +1%, 64 and 2,048 rows within the noise (-4 to +2%).
MIN_ROW_BLOCK = 96
MAX_ROW_BLOCK = 480


L2_BYTES = l2_bytes()
# What a tile stores (the `mode` argument of the kernels): its products, silu(gate) * up of pack_gated's panels,
# or its products added to what C holds.
PLAIN, GATED, ADD = 0, 1, 2


def row_passes(m: int, k: int) -> int:
    """Passes over the panels for an [m, k] input: blocks of about half the core's L2 of rows (ROW_BLOCK when
    the L2 is unknown), within [MIN_ROW_BLOCK, MAX_ROW_BLOCK]; matmul_into evens the rows out over them."""
    target = ROW_BLOCK
    if L2_BYTES:
        target = min(MAX_ROW_BLOCK, max(MIN_ROW_BLOCK, L2_BYTES // 2 // (4 * max(k, 1)) // 12 * 12))
    return max(1, -(-m // target))


@dataclass(frozen=True)
class PackedWeight:
    """A matmul weight [out, in] as column panels [ceil(out / PANEL), in, PANEL] (the last one zero-padded;
    PANEL is 32 with AVX-512, else 16);
    stands where the other sets hold the [in, out] array (`shape`, `dtype`, `nbytes` as that array's)."""

    panels: np.ndarray
    out_features: int
    gated: bool = False  # pack_gated's layout: for matmul_silu_and_mul only

    @property
    def in_features(self) -> int:
        return int(self.panels.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return self.in_features, self.out_features

    @property
    def dtype(self) -> np.dtype:
        return self.panels.dtype

    @property
    def nbytes(self) -> int:
        return int(self.panels.nbytes)


def pack(w: np.ndarray) -> PackedWeight:
    """Panels of a float32 [out, in] weight (read-only, C-contiguous)."""
    return pack_rows([w])


def pack_rows(parts) -> PackedWeight:
    """Panels of the [out, in] weight whose rows are the float32 `parts`' rows in turn (a fused qkv or gate_up
    weight), each part copied straight into its panels: no concatenated copy first (at load, that copy was
    0.25 of a ~2 s warm start). A part that starts inside a panel makes the whole a concatenation first."""
    parts = [np.asarray(w) for w in parts]
    if not parts or any(w.ndim != 2 for w in parts) or len({w.shape[1] for w in parts}) != 1:
        raise ValueError(f"a matmul weight must be [out, in] parts of one in, got shapes {[w.shape for w in parts]}")
    if any(w.shape[0] % PANEL for w in parts[:-1]):
        parts = [np.concatenate(parts)]
    out, k = sum(w.shape[0] for w in parts), parts[0].shape[1]
    panels = aligned_zeros((-(-out // PANEL), k, PANEL))
    at = 0  # the part's first panel
    for w in parts:
        full = w.shape[0] // PANEL
        if full:
            panels[at:at + full] = w[: full * PANEL].reshape(full, PANEL, k).transpose(0, 2, 1)
        if w.shape[0] % PANEL:
            panels[at + full, :, : w.shape[0] % PANEL] = w[full * PANEL :].T
        at += full
    panels.flags.writeable = False
    return PackedWeight(panels, out)


def pack_gated(gate: np.ndarray, up: np.ndarray) -> PackedWeight:
    """A gate_up weight for matmul_silu_and_mul: panel p holds gate rows _LANES p .. _LANES (p + 1) - 1 in its first
    vector's columns and the same rows of up in the second's (zero-padded)."""
    gate, up = np.asarray(gate, dtype=np.float32), np.asarray(up, dtype=np.float32)
    if gate.ndim != 2 or gate.shape != up.shape:
        raise ValueError(f"a gated weight needs gate and up of one [out, in] shape, got {gate.shape}, {up.shape}")
    inter, k = gate.shape
    count = -(-inter // _LANES)
    panels = aligned_zeros((count, k, PANEL))
    for half, w in enumerate((gate, up)):
        padded = np.zeros((count * _LANES, k), dtype=np.float32)
        padded[:inter] = w
        panels[:, :, half * _LANES:(half + 1) * _LANES] = padded.reshape(count, _LANES, k).transpose(0, 2, 1)
    panels.flags.writeable = False
    return PackedWeight(panels, 2 * inter, gated=True)


def matmul_silu_and_mul(x: np.ndarray, w: PackedWeight) -> np.ndarray:
    """silu(x @ gate.T) * (x @ up.T) for pack_gated's w, the SiLU in the GEMM's tiles (no [T, 2I] temporary):
    the same bits as ops.silu_and_mul(matmul(x, pack_rows([gate, up])))."""
    return _multiply(x, w, GATED)


def unpack(p: PackedWeight) -> np.ndarray:
    """The [out, in] weight back (for tests and references; a gated one as its [gate; up] rows)."""
    count, k, _ = p.panels.shape
    if p.gated:
        halves = p.panels.reshape(count, k, 2, _LANES).transpose(2, 0, 3, 1).reshape(2, count * _LANES, k)
        return np.ascontiguousarray(halves[:, : p.out_features // 2].reshape(p.out_features, k))
    return np.ascontiguousarray(p.panels.transpose(0, 2, 1).reshape(count * PANEL, k)[: p.out_features])


def products_ir(builder, a_ptr, a_at, lda, rows, b_ptr, panel_ats, k_v, each_step=None) -> list:
    """LLVM IR of a tile's k loop: accumulators [rows][len(panel_ats) * PANEL / _LANES] (vector allocas) of A's rows
    (row r at a_ptr[a_at + r lda]) times the [k, PANEL] panels at b_ptr[at:] for `at` in panel_ats, each output one
    FMA chain in k order; each step prefetches every panel _PREFETCH_K rows of k ahead, then runs each_step(kk)."""
    intp = a_at.type
    vf = ir.VectorType(ir.FloatType(), _LANES)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{_LANES}f32")
    width = len(panel_ats) * (PANEL // _LANES)
    accs = [[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * _LANES)) for _ in range(width)]
            for _ in range(rows)]
    starts = [builder.add(a_at, builder.mul(lda, ir.Constant(intp, r))) for r in range(rows)]
    with cgutils.for_range(builder, k_v, intp=intp) as loop:
        kk = loop.index
        ats = [builder.add(base, builder.mul(kk, ir.Constant(intp, PANEL))) for base in panel_ats]
        for at in ats:  # 16 floats per 64-byte line; past the end a prefetch is a no-op
            for line in range(0, PANEL, 16):
                ahead = builder.add(at, ir.Constant(intp, _PREFETCH_K * PANEL + line))
                prefetch_ir(builder, builder.gep(b_ptr, [ahead]))
        if each_step is not None:
            each_step(kk)
        panel = [builder.load(builder.bitcast(builder.gep(b_ptr, [builder.add(at, ir.Constant(intp, h * _LANES))]),
                                              vf.as_pointer()), align=4)
                 for at in ats for h in range(PANEL // _LANES)]
        for r in range(rows):
            x = splat(builder, builder.load(builder.gep(a_ptr, [builder.add(starts[r], kk)])), vf)
            for h in range(width):
                builder.store(builder.call(fma, [x, panel[h], builder.load(accs[r][h])]), accs[r][h])
    return accs


def _tile_kernel(rows: int):
    """An intrinsic tile(a, a_at, lda, b, b_at, k, c, c_at, ldc, pf_at, pf_rate): C[rows, 32] = A[rows, :k] @
    panel, with A's row r at a[a_at + r lda], the panel at b[b_at:] ([k, 32]), C's row r at c[c_at + r ldc];
    1-D C float32 arrays. Step kk also prefetches b[pf_at + (kk pf_rate >> 8)] (the tile's share of the next
    panel: _panel_rows)."""

    @intrinsic
    def tile(typingctx, a, a_at, lda, b, b_at, k, c, c_at, ldc, pf_at, pf_rate, mode):
        for arr in (a, b, c):
            if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == "C"
                    and arr.dtype == types.float32):
                return None
        if not all(isinstance(v, types.Integer) for v in (a_at, lda, b_at, k, c_at, ldc, pf_at, pf_rate, mode)):
            return None
        sig = types.void(a, a_at, lda, b, b_at, k, c, c_at, ldc, pf_at, pf_rate, mode)

        def codegen(context, builder, signature, args):
            def data(i):
                return context.make_array(signature.args[i])(context, builder, args[i]).data

            def index(i):
                return context.cast(builder, args[i], signature.args[i], types.intp)

            a_ptr, b_ptr, c_ptr = data(0), data(3), data(6)
            a_at, lda, b_at, k_v, c_at, ldc, pf_at, pf_rate, mode = (index(i) for i in (1, 2, 4, 5, 7, 8, 9, 10, 11))
            intp = a_at.type
            vf = ir.VectorType(ir.FloatType(), _LANES)

            def const(v):
                return ir.Constant(intp, v)

            def vec_at(ptr, offset):
                return builder.bitcast(builder.gep(ptr, [offset]), vf.as_pointer())

            def next_panel_share(kk):  # the tile's share of the next panel (_panel_rows)
                share = builder.gep(b_ptr, [builder.add(pf_at, builder.ashr(builder.mul(kk, pf_rate), const(8)))])
                prefetch_ir(builder, share)

            accs = products_ir(builder, a_ptr, a_at, lda, rows, b_ptr, [b_at], k_v, next_panel_share)
            halves = PANEL // _LANES
            with builder.if_else(builder.icmp_signed("==", mode, const(GATED))) as (fused, other):
                with fused:  # a gated panel: gate in the first vector, up in the second; C gets silu(gate) * up
                    for r in range(rows):
                        y = silu_mul_ir(builder, builder.load(accs[r][0]), builder.load(accs[r][1]))
                        builder.store(y, vec_at(c_ptr, builder.add(c_at, builder.mul(ldc, const(r)))), align=4)
                with other:
                    with builder.if_else(builder.icmp_signed("==", mode, const(ADD))) as (adding, plain):
                        for branch, add in ((adding, True), (plain, False)):
                            with branch:  # ADD: C = C + tile (the residual add's one rounding), else C = tile
                                for r in range(rows):
                                    row_at = builder.add(c_at, builder.mul(ldc, const(r)))
                                    for h in range(halves):
                                        at = vec_at(c_ptr, builder.add(row_at, const(h * _LANES)))
                                        y = builder.load(accs[r][h])
                                        if add:
                                            y = builder.fadd(builder.load(at, align=4), y)
                                        builder.store(y, at, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


_TILE_BIG, _TILE8, _TILE4, _TILE2, _TILE1 = (_tile_kernel(r) for r in (_BIG_ROWS, 8, 4, 2, 1))


def _panel_rows(a, a_at, lda, m, b, b_at, k, c, c_at, ldc, mode):
    """C rows 0 .. m - 1 (row r: PANEL floats at c[c_at + r ldc]) = A rows (row r: k floats at a[a_at + r lda])
    @ the panel at b[b_at:] ([k, PANEL]): tiles of _BIG_ROWS rows, then 8 (AVX-512), 4, 2 and 1 for the rest.
    Each tile also prefetches its share of the next panel (b[b_at + k PANEL:], the next one a thread takes in
    matmul_into), spread over its k steps: only a thread's first panel comes from memory while its tiles wait.
    (Until then a panel's first tile read it from memory at a line per 6 cycles of FMAs, twice what a core
    streams, and the other tiles found it in L2.)"""
    tiles = m // _BIG_ROWS
    rest = m - tiles * _BIG_ROWS
    if AVX512 and rest >= 8:
        tiles += 1
        rest -= 8
    tiles += (rest >= 4) + (rest % 4 >= 2) + (rest % 2)
    nxt = b_at + k * PANEL  # the next panel
    share = k * PANEL // max(tiles, 1)  # floats of it per tile
    rate = min(256 * PANEL // max(tiles, 1), 256 * 16)  # floats per k step, x 256; at most a line a step
    t = 0
    r = 0
    while r + _BIG_ROWS <= m:
        _TILE_BIG(a, a_at + r * lda, lda, b, b_at, k, c, c_at + r * ldc, ldc, nxt + t * share, rate, mode)
        r += _BIG_ROWS
        t += 1
    if r + 8 <= m:  # AVX-512 only: AVX2's 6-row tiles leave at most 5
        _TILE8(a, a_at + r * lda, lda, b, b_at, k, c, c_at + r * ldc, ldc, nxt + t * share, rate, mode)
        r += 8
        t += 1
    if r + 4 <= m:
        _TILE4(a, a_at + r * lda, lda, b, b_at, k, c, c_at + r * ldc, ldc, nxt + t * share, rate, mode)
        r += 4
        t += 1
    if r + 2 <= m:
        _TILE2(a, a_at + r * lda, lda, b, b_at, k, c, c_at + r * ldc, ldc, nxt + t * share, rate, mode)
        r += 2
        t += 1
    if r < m:
        _TILE1(a, a_at + r * lda, lda, b, b_at, k, c, c_at + r * ldc, ldc, nxt + t * share, rate, mode)


# A function of its own, called by address (numba_setup.call_compiled) by matmul_into's work items and
# numba_prefill's: their compiles hold no copy of the tiles' unrolled code.
PANEL_ROWS = numba.njit(**JIT_EXACT)(_panel_rows)


@functools.lru_cache(maxsize=None)
def panel_rows_address() -> int:
    """PANEL_ROWS' machine code for flat float32 arrays (launch.array1's type), compiled or loaded once."""
    row, zero = np.zeros(1, dtype=np.float32), np.int64(0)
    return native_address(PANEL_ROWS, (row, zero, zero, zero, row, zero, zero, row, zero, zero, zero))


@numba.njit(**JIT_EXACT)
def _panel_item(p, words):
    """Panel p of one pass of matmul_into (a launch.py item). words: x, the panels and out (flat), the pass's
    first row and row count, k, n, the panel's output columns, mode, PANEL_ROWS' address."""
    m0, k, n = words[6], words[8], words[9]
    call_compiled(words[12], (array1(words, 0, np.float32), m0 * k, k, words[7], array1(words, 2, np.float32),
                              p * k * PANEL, k, array1(words, 4, np.float32), m0 * n + p * words[10], n, words[11]))


def matmul_into(x: np.ndarray, panels: np.ndarray, out: np.ndarray, passes: int, mode: int) -> None:
    """out [m, panels * PANEL] = x [m, k] @ the weight of `panels` [count, k, PANEL] (mode ADD: out +=; GATED:
    pack_gated's panels, out [m, panels * PANEL / 2]), the rows in `passes` blocks of about equal size, each
    starting on a whole big tile (row_passes): one parallel pass over the panels per block, a panel an item
    (launch.py); all C-contiguous float32 (the kernel itself: `_multiply` checks, allocates and slices)."""
    m, k = x.shape
    count = panels.shape[0]
    width = _LANES if mode == GATED else PANEL  # output columns per panel
    flat = (x.reshape(-1), panels.reshape(-1), out.reshape(-1))
    item, kernel = item_address(_panel_item), panel_rows_address()
    for i in range(passes):
        m0 = (i * m // passes) // 12 * 12
        m1 = m if i == passes - 1 else ((i + 1) * m // passes) // 12 * 12
        if m1 > m0:
            run_parts(item, count, (*flat, m0, m1 - m0, k, count * width, width, mode, kernel))


def matmul(x: np.ndarray, w: PackedWeight, bias: np.ndarray | None = None) -> np.ndarray:
    """x [T, in] @ W.T (+ bias) -> [T, out] float32; ops.linear(x, unpack(w).T, bias) is the reference."""
    out = _multiply(x, w, PLAIN)
    if bias is not None:
        out += bias
    return out


def matmul_add(x: np.ndarray, w: PackedWeight, out: np.ndarray) -> np.ndarray:
    """out += x @ W.T in place, the add in the GEMM's tiles (C-contiguous float32 out [T, out_features], W's
    columns a whole number of panels): the same bits as out += matmul(x, w), without the [T, out] temporary
    written and read again (the decoder layer's residual add after o_proj and down)."""
    if not adds_into(x, w, out):
        raise ValueError(f"matmul_add: out {out.dtype} {out.shape} must be a writable C-contiguous float32 "
                         f"[{x.shape[0]}, {w.out_features}], of whole {PANEL}-column panels")
    return _multiply(x, w, ADD, out)


def adds_into(x: np.ndarray, w: PackedWeight, out: np.ndarray) -> bool:
    """Whether matmul_add can add x @ W.T into `out` in its tiles: a writable C-contiguous float32 [T, out_features]
    of a plain weight with whole panels (no padded columns to store)."""
    return (not w.gated and not w.out_features % PANEL and out.dtype == np.float32 and out.flags.c_contiguous
            and out.flags.writeable and out.shape == (x.shape[0], w.out_features))


def _multiply(x: np.ndarray, w: PackedWeight, mode: int, out: np.ndarray | None = None) -> np.ndarray:
    """matmul's output (PLAIN), matmul_silu_and_mul's (GATED: w must be pack_gated's, and only then) or
    matmul_add's (ADD, into `out`)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    gated = mode == GATED
    if x.ndim != 2 or x.shape[1] != w.in_features or w.gated != gated:
        raise ValueError(f"packed linear: input of shape {x.shape} for a weight of [in, out] = {w.shape}"
                         + (" (gated: matmul_silu_and_mul)" if w.gated else " (not gated)" if gated else ""))
    width = _LANES if gated else PANEL  # output columns per panel
    if out is None:
        out = aligned_empty((x.shape[0], w.panels.shape[0] * width))
    if x.shape[0]:
        apply_threads(parallel=True)
        matmul_into(x, w.panels, out, row_passes(x.shape[0], x.shape[1]), mode)
    features = w.out_features // 2 if gated else w.out_features
    return out if out.shape[1] == features else np.ascontiguousarray(out[:, :features])


def warm_up() -> None:
    """Compile the kernel for the types the model passes (read-only panels, as pack makes them)."""
    matmul(np.ones((11, 8), dtype=np.float32), pack(np.ones((40, 8), dtype=np.float32)))
