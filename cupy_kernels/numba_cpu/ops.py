"""numba versions of the elementwise ops in ops.py (fused add+RMSNorm, rotary, SiLU-and-mul), the KV
cache writes of paged_attention.py (cache_write.py, importable from here), and the CPU set's linear
(weights packed at load: numba_gemm.py; a few rows by GGUF blocks: numba_quant.py). Same signatures and
results as those numpy references, within float32 rounding; tests/cupy_kernels/test_numba_ops.py compares
them. The numerics the kernels share (fast_exp, fast_exp2, row_max) are in numerics.py, and importable from
here.

Why compile these at all: the numpy versions make several passes over [T, hidden] activations with a
temporary each (add, square, sum, divide, multiply; negate, exp, add, divide, multiply) while one loop here
reads each value once. Three things make the loops vectorise (AVX2/AVX-512 on the CPU numba compiles for):
`error_model="numpy"` (no ZeroDivisionError check per division), a polynomial exp (`fast_exp`: numba's
np.exp is a scalar libm call, so SiLU would be slower than numpy's SIMD exp), and 1-D loops over row views.

Small batches (decode steps) run on one thread: waking threads costs more than a few hundred rows take,
and on a host shared with other work a parallel loop waits for its slowest thread. Every loop computes a
row from that row alone, and each kernel is compiled once (numba_setup.apply_threads), so the thread
count never changes a result.
"""

from __future__ import annotations

import numpy as np

from . import gemm as numba_gemm, gemm_rotary as numba_gemm_rotary, quant as numba_quant, setup as numba_setup
from ..host.malloc import aligned_empty
from ..reference import ops
from .attention_ir import address
from .launch import array1, array2, float_at, item_address, run_parts
# The KV cache writes, a kernel set's ops like the others (cache_write.py)
from .cache_write import PARALLEL_MIN_TOKENS, reshape_and_cache, rotary_and_cache  # noqa: F401
# fast_exp2 and row_max: read from here too
from .numerics import fast_exp, fast_exp2, rotate, row_argmax, row_max, silu_mul  # noqa: F401
from .setup import JIT, JIT_EXACT, apply_threads, numba

# Rows from which the elementwise kernels use numba's thread pool (a row a launch.py item). SiLU-and-mul does
# ~3 ns of work per row element (an exp and a division) and shares from 16 rows; add+RMSNorm too, its rows cold
# in cache after the matmuls (docs/notes/kernels.md). Batch invariance holds: a row is computed by the same
# compiled code on whichever thread.
PARALLEL_MIN_ROWS = 256
SILU_PARALLEL_MIN_ROWS = 16
NORM_PARALLEL_MIN_ROWS = 16
_F32 = np.dtype(np.float32)
_f32 = np.float32  # (the dtype argument of launch.array1 .. array4 inside the items)


def _kernel(fn, options=JIT):
    return numba.njit(parallel=True, **options)(fn)


def _item(fn, options=JIT):
    """A row kernel f(row, words) run by launch.py's shared prange (no prange of its own to compile)."""
    return numba.njit(**options)(fn)


def _run(item, count: int, parallel: bool, parts: tuple) -> None:
    """Items 0 .. count-1 of `item` on `parts` (launch.run_parts), on numba's threads if `parallel` (and more
    than one item, numba_setup.apply_threads), else one after the other on this thread (the same compiled item:
    the same bits)."""
    if parallel and count > 1:
        apply_threads(parallel=True)
        run_parts(item_address(item), count, parts)
    else:
        run_parts(item_address(item), count, parts, serial=True)


def _c(a: np.ndarray) -> np.ndarray:
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _threads_for(kernel, rows: int, min_rows: int = PARALLEL_MIN_ROWS):
    """The kernel, with this thread's numba pool set to one thread below `min_rows` rows (numba_setup)."""
    apply_threads(parallel=rows >= min_rows)
    return kernel


# -- linear ---------------------------------------------------------------------------------------------

def linear(x: np.ndarray, weight_t, bias: np.ndarray | None = None, quant=None) -> np.ndarray:
    """ops.linear on this set's weights, packed at load (pack_weight): up to numba_quant.QUANT_MAX_ROWS rows,
    a weight with GGUF blocks (`quant`) is read as blocks (numba_quant.py: 0.75-1.1 byte per weight
    instead of 4; unless PAGEDSERVE_BATCH_INVARIANT), anything else by the packed GEMM (numba_gemm.py). A
    plain [in, out] array (a weight of another dtype) takes numpy's matmul."""
    if isinstance(weight_t, numba_gemm.PackedWeight):
        if _reads_blocks(x, quant):
            return numba_quant.linear(x, quant, bias)
        if weight_t.gated:
            return _gated_products(x, weight_t, bias)
        return numba_gemm.matmul(x, weight_t, bias)
    return ops.linear(x, weight_t, bias)


def _gated_products(x: np.ndarray, w: numba_gemm.PackedWeight, bias: np.ndarray | None) -> np.ndarray:
    """[gate | up] = x @ [gate; up].T [T, 2I] from a gated weight's panels (pack_gated: each panel holds _LANES
    gate columns then the same up columns): the plain GEMM over those panels, its columns put back in order. A
    LoRA step adds its gate/up deltas here before silu_and_mul, while base-only steps keep the fused SiLU on the
    same panels (models/lora.py); each output is the GEMM's one FMA chain, so the bits are matmul's."""
    x = np.ascontiguousarray(x, dtype=_F32)
    if x.ndim != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"packed linear: input of shape {x.shape} for a weight of [in, out] = {w.shape}")
    count, inter, lanes = w.panels.shape[0], w.out_features // 2, numba_gemm.PANEL // 2
    raw = aligned_empty((x.shape[0], count * numba_gemm.PANEL))
    if x.shape[0]:
        apply_threads(parallel=True)
        numba_gemm.matmul_into(x, w.panels, raw, numba_gemm.row_passes(*x.shape), numba_gemm.PLAIN)
    halves = raw.reshape(x.shape[0], count, 2, lanes).transpose(0, 2, 1, 3).reshape(x.shape[0], 2, count * lanes)
    out = np.ascontiguousarray(halves[:, :, :inter]).reshape(x.shape[0], 2 * inter)
    if bias is not None:
        out += bias
    return out


def pack_weight(w, gated: bool = False) -> numba_gemm.PackedWeight | None:
    """The form this set's linear wants a float32 [out, in] matmul weight in: column panels
    (numba_gemm.py); a list of [out_i, in] parts is packed as their rows in turn, without concatenating them
    first. gated: [gate, up], for linear_silu_and_mul only (numba_gemm.pack_gated: the two side by side in each
    panel). None for another dtype (the caller then keeps the [in, out] array)."""
    parts = list(w) if isinstance(w, (list, tuple)) else [w]
    if any(np.asarray(p).dtype != _F32 for p in parts):
        return None
    if gated:
        if len(parts) != 2:
            raise ValueError(f"a gated weight is packed from [gate, up], got {len(parts)} parts")
        return numba_gemm.pack_gated(*parts)
    return numba_gemm.pack_rows(parts)


def linear_silu_and_mul(x: np.ndarray, weight_t, quant=None) -> np.ndarray:
    """ops.linear_silu_and_mul: on a gated weight (pack_weight(..., gated=True)) the SiLU-and-mul runs in the
    GEMM's tiles, before they store (numba_gemm.matmul_silu_and_mul: the same bits, and no [T, 2I] temporary
    written and read again); few rows with GGUF blocks take the blocks, then silu_and_mul, as linear does."""
    if not (isinstance(weight_t, numba_gemm.PackedWeight) and weight_t.gated):
        return silu_and_mul(linear(x, weight_t, quant=quant))
    if _reads_blocks(x, quant):
        return silu_and_mul(numba_quant.linear(x, quant))
    return numba_gemm.matmul_silu_and_mul(x, weight_t)


def linear_add(x: np.ndarray, weight_t, residual: np.ndarray, quant=None) -> np.ndarray:
    """ops.linear_add: on packed panels the GEMM's tiles add into residual (numba_gemm.matmul_add: the same bits
    as residual += linear(...), no [T, out] output written and read again); few rows with GGUF blocks, another
    weight form or a residual the tiles cannot write take the composition."""
    if (isinstance(weight_t, numba_gemm.PackedWeight) and not _reads_blocks(x, quant)
            and numba_gemm.adds_into(x, weight_t, residual)):
        return numba_gemm.matmul_add(x, weight_t, residual)
    residual += linear(x, weight_t, quant=quant)
    return residual


def linear_rotary_cache(x: np.ndarray, weight_t, num_heads: int, num_kv_heads: int, cos, sin, k_cache, v_cache,
                        slot_mapping, quant=None) -> np.ndarray:
    """paged_attention.linear_rotary_cache: on packed panels the rotation and the K/V slot writes run in the GEMM's
    tiles (numba_gemm_rotary: the same bits, no [T, (H + 2 KV) D] output written and read again); few rows with
    GGUF blocks, another weight form or caches the tiles cannot stream to take linear, then rotary_and_cache."""
    if (isinstance(weight_t, numba_gemm.PackedWeight) and not _reads_blocks(x, quant)
            and numba_gemm_rotary.fuses(x, weight_t, num_heads, num_kv_heads, cos, sin, k_cache, v_cache)):
        return numba_gemm_rotary.matmul_rotary_cache(x, weight_t, num_heads, num_kv_heads, cos, sin, k_cache, v_cache,
                                                     slot_mapping)
    return rotary_and_cache(linear(x, weight_t, quant=quant), num_heads, num_kv_heads, cos, sin, k_cache, v_cache,
                            slot_mapping)


def _reads_blocks(x: np.ndarray, quant) -> bool:
    """Whether a matmul of x reads the weight's GGUF blocks (numba_quant) rather than its panels."""
    return quant is not None and x.shape[0] <= numba_quant.QUANT_MAX_ROWS and not numba_setup.BATCH_INVARIANT


# -- add + RMSNorm ------------------------------------------------------------------------------------


def _add_rms_norm_row(t, words):
    """Row t of add_rms_norm (a launch.py item; words: x, residual, weight, eps, out, add). add: residual += x,
    then normalise the residual; else normalise x (residual is not touched)."""
    x, rr = array2(words, 0, _f32)[t], array2(words, 3, _f32)[t]
    weight, eps, o, add = array1(words, 6, _f32), np.float32(float_at(words, 8)), array2(words, 9, _f32)[t], words[12]
    hidden = x.shape[0]
    ss = np.float32(0.0)
    if add:
        for i in range(hidden):
            v = rr[i] + x[i]
            rr[i] = v
            ss += v * v
    else:
        for i in range(hidden):
            ss += x[i] * x[i]
    scale = np.sqrt(ss / np.float32(hidden) + eps)
    src = rr if add else x
    for i in range(hidden):
        o[i] = src[i] / scale * weight[i]


_ADD_RMS_NORM = _item(_add_rms_norm_row)


def add_rms_norm(x: np.ndarray, residual: np.ndarray | None, weight: np.ndarray, eps: float):
    """ops.add_rms_norm in one pass per row: residual += x (in place), then RMSNorm of it."""
    if (x.dtype != _F32 or x.ndim != 2 or weight.dtype != _F32
            or (residual is not None and (residual.dtype != _F32 or residual.shape != x.shape
                                          or not residual.flags.c_contiguous))):
        return ops.add_rms_norm(x, residual, weight, eps)  # (the item reads float32 C-contiguous rows)
    if residual is None:  # the first layer: x itself becomes the residual
        return rms_norm(x, weight, eps), x
    out = np.empty(x.shape, dtype=_F32)
    rows = x.shape[0]
    _run(_ADD_RMS_NORM, rows, rows >= NORM_PARALLEL_MIN_ROWS, (_c(x), residual, _c(weight), float(eps), out, True))
    return out, residual


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    if x.dtype != _F32 or x.ndim != 2 or weight.dtype != _F32:
        return ops.rms_norm(x, weight, eps)
    out, x = np.empty(x.shape, dtype=_F32), _c(x)
    rows = x.shape[0]
    _run(_ADD_RMS_NORM, rows, rows >= NORM_PARALLEL_MIN_ROWS, (x, x, _c(weight), float(eps), out, False))
    return out


# -- rotary ------------------------------------------------------------------------------------------


def _rotary_rows(x, cos, sin, out):
    heads, head_dim = x.shape[1], x.shape[2]
    src, cs, sn, dst = address(x), address(cos), address(sin), address(out)
    for t in numba.prange(x.shape[0]):
        for h in range(heads):
            at = (t * heads + h) * head_dim
            rotate(src, at, cs, sn, t * cos.shape[1], dst, at, head_dim // 2)


_ROTARY = _kernel(_rotary_rows, JIT_EXACT)


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """ops.apply_rotary ("neox" rotate-half) in one pass, each head by numerics.rotate (rotary_and_cache's
    rotation); x [T, heads, D] may be a strided view of qkv (copied first: the model calls rotary_and_cache)."""
    if x.dtype != _F32:
        return ops.apply_rotary(x, cos, sin)
    out = np.empty(x.shape, dtype=_F32)
    x, cos, sin = (np.ascontiguousarray(a, dtype=_F32) for a in (x, cos, sin))
    _threads_for(_ROTARY, x.shape[0])(x, cos, sin, out)
    return out


# -- SiLU and mul ------------------------------------------------------------------------------------


def _silu_and_mul_row(t, words):
    """Row t of silu_and_mul (a launch.py item; words: x [T, 2I], out [T, I])."""
    inter = words[5]  # out's second extent
    xa, oa = words[0], words[3]  # byte addresses: row t's gate at xa + 4 (2 inter t), its up after it
    silu_mul(xa + 4 * t * 2 * inter, xa + 4 * (t * 2 * inter + inter), oa + 4 * t * inter, inter)


_SILU_AND_MUL = _item(_silu_and_mul_row, JIT_EXACT)


def silu_and_mul(x: np.ndarray) -> np.ndarray:
    """ops.silu_and_mul: x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I], in one pass."""
    if x.dtype != _F32 or x.ndim != 2:
        return ops.silu_and_mul(x)
    x = _c(x)  # (the kernel reads it by address)
    out = np.empty((x.shape[0], x.shape[1] // 2), dtype=_F32)
    _run(_SILU_AND_MUL, x.shape[0], x.shape[0] >= SILU_PARALLEL_MIN_ROWS, (x, out))
    return out


@numba.njit(inline="always", **JIT)
def _log_sum_exp(row, mb):
    """log(sum(exp(row))) given the row's max mb: the one loop logsumexp_rows and argmax_rows (lse_out) share,
    so both round alike."""
    s = np.float32(0.0)
    for j in range(row.shape[0]):
        s += fast_exp(row[j] - mb)
    return mb + np.log(s)


def _logsumexp_row(b, words):
    """Row b of logsumexp_rows (a launch.py item; words: x [B, V], the rows' maxima [B] (if has_max), has_max,
    out [B])."""
    row, out = array2(words, 0, _f32)[b], array1(words, 6, _f32)
    out[b] = _log_sum_exp(row, array1(words, 3, _f32)[b] if words[5] else row_max(row, row.shape[0]))


_LOGSUMEXP_ROWS = _item(_logsumexp_row)
# Elements from which logsumexp_rows shares its rows over the threads (one vocabulary row: 49,152).
LOGSUMEXP_PARALLEL_MIN = 1 << 17


def logsumexp_rows(x: np.ndarray, row_max: np.ndarray | None = None) -> np.ndarray:
    """ops.logsumexp_rows in one compiled pass per row (max, then sum of fast_exp), rows shared over the
    threads: 4.8 ms for a 256-row decode step of SmolLM2 on the AVX2 test host, where numpy's three passes on
    one thread take 32.8 ms."""
    x = np.ascontiguousarray(x, dtype=_F32)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"logsumexp_rows: x must be [B, V] with V >= 1, got shape {x.shape}")
    has_max = row_max is not None
    m = np.ascontiguousarray(row_max, dtype=_F32) if has_max else np.empty(0, dtype=_F32)
    if has_max and m.shape != (x.shape[0],):
        raise ValueError(f"logsumexp_rows: row_max of shape {m.shape} for x of shape {x.shape}")
    out = np.empty(x.shape[0], dtype=_F32)
    if x.shape[0]:
        _run(_LOGSUMEXP_ROWS, x.shape[0], x.size >= LOGSUMEXP_PARALLEL_MIN, (x, m, has_max, out))
    return out


def _argmax_row(b, words):
    """Row b of argmax_rows (a launch.py item; words: x [B, V], out [B] int64, lse [B] (if with_lse), with_lse)."""
    row = array2(words, 0, _f32)[b]
    j = row_argmax(row, row.shape[0])
    array1(words, 3, np.int64)[b] = j
    if words[7]:
        array1(words, 5, _f32)[b] = _log_sum_exp(row, row[j])


# numerics.row_argmax's NaN rules are IR compares that fast-math flags do not touch; the sum is compiled with
# _logsumexp_rows's flags (JIT), so it vectorises, and rounds, as that one does.
_ARGMAX_ROWS = _item(_argmax_row)


def argmax_rows(x: np.ndarray, axis: int = 1, lse_out: np.ndarray | None = None) -> np.ndarray:
    """np.argmax(x, axis=1) of a [B, V] float32 array (the first NaN, else the first largest value), rows shared
    over the threads, each in vector lanes (numerics.row_argmax): the sampler's greedy rows. With lse_out (a
    float32 [B] array), also each row's log-sum-exp, logsumexp_rows(x, its max)'s bits, summed while the row is
    still in the core's cache: the sampler's all-greedy steps read their logits once instead of twice. A
    256-row decode step's logits (V = 49,152), cache-resident: 1.25 ms against numpy's 1.95 on one thread."""
    if axis != 1 or x.dtype != _F32 or x.ndim != 2 or x.shape[1] == 0:
        if lse_out is not None:
            raise ValueError(f"argmax_rows: lse_out needs float32 [B, V >= 1] rows along axis 1, got {x.dtype} "
                             f"{x.shape}, axis {axis}")
        return np.argmax(x, axis=axis)
    x = np.ascontiguousarray(x)
    out = np.empty(x.shape[0], dtype=np.int64)
    with_lse = lse_out is not None
    if with_lse and (lse_out.dtype != _F32 or lse_out.shape != (x.shape[0],)):
        raise ValueError(f"argmax_rows: lse_out must be float32 of shape ({x.shape[0]},), got {lse_out.dtype} "
                         f"{lse_out.shape}")
    if x.shape[0]:
        lse = lse_out if with_lse and lse_out.flags.c_contiguous else np.empty(x.shape[0] if with_lse else 0, _F32)
        _run(_ARGMAX_ROWS, x.shape[0], x.size >= LOGSUMEXP_PARALLEL_MIN, (x, out, lse, with_lse))
        if with_lse and lse is not lse_out:  # a strided lse_out (the item writes C-contiguous rows)
            lse_out[...] = lse
    return out


def warm_up() -> None:
    """Compile (or load from the cache) the kernels the model calls, for the types it passes (C-contiguous
    arrays, read-only weights). A type seen first during a request would compile then
    (tests/cupy_kernels/test_numba_warm_up.py runs the model and checks that none does). apply_rotary and
    reshape_and_cache, which the model no longer calls (rotary_and_cache does both, on the qkv array
    itself), compile at their first call."""
    f32 = lambda *shape: np.ones(shape, dtype=_F32)  # noqa: E731
    w, eps = f32(8), np.float32(1e-6)
    w.flags.writeable = False  # the model's weights are read-only (LlamaForCausalLM._put)
    add_rms_norm(f32(2, 8), f32(2, 8), w, eps)
    rms_norm(f32(2, 8), w, eps)
    silu_and_mul(f32(2, 8))
    logsumexp_rows(f32(2, 8))
    logsumexp_rows(f32(2, 8), f32(2))
    argmax_rows(f32(2, 8))
    argmax_rows(f32(2, 8), lse_out=np.empty(2, dtype=_F32))
    cache = np.zeros((2, 4, 2, 4), dtype=_F32)
    rotary_and_cache(f32(2, 32), 4, 2, f32(2, 2), f32(2, 2), cache, cache.copy(), np.zeros(2, dtype=np.int64))
    # A call of few tokens runs the serial kernel alone; from PARALLEL_MIN_TOKENS (with threads to share) the
    # prange around it: both compiled here (padding slots: nothing is written).
    n = PARALLEL_MIN_TOKENS
    rotary_and_cache(f32(n, 32), 4, 2, f32(n, 2), f32(n, 2), cache, cache.copy(), np.full(n, -1, dtype=np.int64))
