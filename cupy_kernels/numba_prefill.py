"""Long prefill chunks for the numba set's paged attention: Q.K^T and P.V through numba_gemm's register-
tiled kernel, the masked softmax between them compiled with numba. Same result as
paged_attention.paged_attention (the numpy reference) within float32 rounding;
tests/cupy_kernels/test_numba_prefill.py compares them.

Why a second path: a chunk of n query tokens against L keys is two matmuls of n*G x 64 x L per kv head
(G query heads share a kv head). At n = 240, L = 4,000 (bench/jitter.py's last chunks) numba_attention's
loop nest, built for decodes (one row per key, reading K/V in place), ran at ~40 GFLOP/s: 1.6 s of a
step's attention against ~0.2 s as matmuls. The reference's numpy softmax (five passes over a [n*G, L]
array, numpy's exp) then took twice the matmuls; here it is one pass per row, and rows are taken a tile at
a time so a tile's scores stay in the L3 cache between the three steps.

The matmuls were OpenBLAS's until the packed GEMM: 2 x 0.83 ms per kv head at n*G = 720, L = 3,900
against 0.72 + 0.69, and for short prompts (128 tokens, 256 requests in bench/throughput.py) 0.8 ms per
sequence and layer against 0.26 (OpenBLAS's threads, asleep 75 us after a call, likely woke for each).

Per sequence and kv head:

    K_h, V_h = the sequence's L key/value rows of head h, copied out of its blocks into panels (once)
    for each tile of query rows (token t, group g):
        S = Q_tile . K_h^T                      packed GEMM (K_h as the weight)
        P = 2^(S - rowmax) on keys <= the row's position, 0 past it; l = row sum     (numba; Q pre-scaled
                                                                by scale * log2(e): S in log2 units)
        out rows = (P . V_h) / l                packed GEMM (V_h^T as the weight)

A row's result depends only on its own sequence and position (never on the batch): batch invariance
holds. It is not the same arithmetic as numba_attention's loop nest, so a prompt computed in one chunk
and in several chunks (some taking the other path) may differ in the last bits; set
PAGEDSERVE_BATCH_INVARIANT=1 to run every chunk through the loop nest (slower long prefills).
"""

from __future__ import annotations

import threading

import numpy as np

from .numba_gemm import PANEL, matmul_into
from .numba_ops import fast_exp2, row_max
from .numba_setup import JIT, JIT_EXACT, apply_threads, numba

# A sequence's chunk takes this path when it has at least MIN_TOKENS new tokens and the loop nest would cost
# more. The loop nest computes only the (query token, key) pairs a token sees, n (L - (n - 1) / 2) for n new
# tokens over a context of L; the matmuls compute the whole n x L rectangle (the masked half of a prompt's
# own keys included) but at a better rate, plus a cost per sequence (gather, calls). Measured on 2 cores
# with SmolLM2's shapes (bench/attention_paths.py, docs/benchmarks.md): ~40 ns a seen pair in the loop nest,
# ~21 ns a rectangle pair in the matmuls (~30 for small ones) and ~0.4 ms per sequence. So a whole prompt
# (L = n) stays in the loop nest up to ~2,048 tokens (16 prompts of 128: 5.5 against 12.0 ms a layer), and
# a chunk deep in a long context (240 new over 4,000) takes the matmuls (22 against 29 ms).
MIN_TOKENS = 16
LOOP_NEST_PAIR_COST = 1.9  # a seen pair in the loop nest, in rectangle pairs of the matmul path
MATMUL_FIXED_PAIRS = 20_000  # the matmul path's cost per sequence, in rectangle pairs
# Query rows (token, group head) per score tile: at most ROW_TILE, and fewer for long contexts so a tile's
# scores (rows x context x 4 B) stay within TILE_BYTES, in the L3 cache between the three steps. One
# tile per kv head for bench/jitter.py's 240-token chunks (720 rows x 4,000 keys = 11 MB).
ROW_TILE = 768
TILE_BYTES = 12 << 20
_F32 = np.dtype(np.float32)
LOG2_E = 1.4426950408889634


def _masked_softmax_rows(s, first_pos, group, inv_den):
    """In place over s [R, L] (scores, already scaled, in log2 units): row r (token r // group, at position
    first_pos + r // group) keeps 2^(s - max) on keys <= its position and 0 past it; inv_den[r] = 1 / the
    kept sum."""
    rows, keys = s.shape
    for r in numba.prange(rows):
        row = s[r]
        seen = min(keys, first_pos + r // group + 1)
        m = row_max(row, seen)
        total = np.float32(0.0)
        for j in range(seen):
            p = fast_exp2(row[j] - m)
            row[j] = p
            total += p
        for j in range(seen, keys):
            row[j] = 0.0
        inv_den[r] = np.float32(1.0) / total


_SOFTMAX = numba.njit(parallel=True, **JIT)(_masked_softmax_rows)


def takes_matmul_path(num_new: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Which sequences of a batch this path computes, by their own sizes only (never the batch's): chunks of
    at least MIN_TOKENS new tokens whose seen pairs would cost the loop nest more than the rectangle costs
    the matmuls."""
    seen = num_new * (seq_lens - (num_new - 1) / 2)
    return (num_new >= MIN_TOKENS) & (LOOP_NEST_PAIR_COST * seen > num_new * seq_lens + MATMUL_FIXED_PAIRS)


def _gather_panels(k_cache, v_cache, block_table, context_len, kp, vp):
    """The sequence's keys and values, out of its blocks, in numba_gemm's panel layout (P = PANEL):
    kp[h, c, d, j] = K[h, c P + j, d] (the keys as a [L, D] weight: S = Q . K^T), vp[h, c, p, j] =
    V[h, p, c P + j] (the values as a [D, L] weight: O = P . V); positions past context_len and head dims
    past D are zero (a score there is masked to 0, and 0 * garbage could be NaN). Parallel over panels."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    panel = kp.shape[3]
    for c in numba.prange(kp.shape[1]):
        for j in range(panel):
            p = c * panel + j
            inside = p < context_len
            block = block_table[p // block_size] if inside else 0
            i = p % block_size
            for h in range(num_kv_heads):
                for d in range(head_dim):
                    kp[h, c, d, j] = k_cache[block, i, h, d] if inside else np.float32(0.0)
                for cv in range(vp.shape[1]):
                    for jv in range(panel):
                        d = cv * panel + jv
                        vp[h, cv, p, jv] = v_cache[block, i, h, d] if inside and d < head_dim else np.float32(0.0)


_GATHER = numba.njit(parallel=True, **JIT_EXACT)(_gather_panels)


_local = threading.local()


def _buffer(name: str, size: int) -> np.ndarray:
    """A float32 buffer of at least `size`, kept per thread and grown as needed."""
    buf = getattr(_local, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(max(size, 2 * buf.size if buf is not None else 0), dtype=_F32)
        setattr(_local, name, buf)
    return buf


def _workspace(num_kv_heads: int, key_panels: int, value_panels: int, head_dim: int, rows: int):
    """Key and value panels, scores [rows, padded context], row factors and P.V's output [rows, padded
    head dim], views of buffers kept per thread. Fresh multi-megabyte arrays each layer cost more than the
    copy itself: the allocator hands them out as new pages, and first-touch page faults ran at ~2.5 s per
    GiB on the test VM (3 ms of a 12 ms layer at 4,000 keys)."""
    padded = key_panels * PANEL
    kv = num_kv_heads * key_panels * head_dim * PANEL
    vv = num_kv_heads * value_panels * padded * PANEL
    k_and_v = _buffer("kv", kv + vv)
    width = value_panels * PANEL
    scores = _buffer("scores", rows * (padded + 1 + width))
    at = rows * (padded + 1)
    return (k_and_v[:kv].reshape(num_kv_heads, key_panels, head_dim, PANEL),
            k_and_v[kv:kv + vv].reshape(num_kv_heads, value_panels, padded, PANEL),
            scores[:rows * padded].reshape(rows, padded), scores[rows * padded:at],
            scores[at:at + rows * width].reshape(rows, width))


def _as_weight(panels: np.ndarray) -> np.ndarray:
    """A read-only view of workspace panels: the argument types of the model's weights (numba_gemm.pack), so
    the GEMM runs the machine code compiled for those instead of compiling (~1.2 s) a second one."""
    view = panels.view()
    view.flags.writeable = False
    return view


def prefill_sequence(query, k_cache, v_cache, start: int, end: int, context_len: int, block_table, scale: float,
                     out) -> None:
    """out[start:end] = attention of query rows start:end (the sequence's new tokens, the last of its
    context_len positions) over its context, causal within the chunk."""
    n = end - start
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    first_pos = context_len - n
    apply_threads(parallel=True)
    key_panels = -(-context_len // PANEL)
    value_panels = -(-head_dim // PANEL)
    padded = key_panels * PANEL
    tile_tokens = max(1, min(ROW_TILE, TILE_BYTES // (4 * padded)) // group)
    rows = tile_tokens * group
    kp, vp, s, inv_den, pv = _workspace(num_kv_heads, key_panels, value_panels, head_dim, rows)
    # Scores in log2 units, so the softmax takes 2^x (fast_exp2, cheaper than exp): the same weights.
    q_scale = np.float32(scale * LOG2_E)
    _GATHER(k_cache, v_cache, block_table, context_len, kp, vp)
    for h in range(num_kv_heads):
        heads = slice(h * group, (h + 1) * group)
        k_h, v_h = _as_weight(kp[h]), _as_weight(vp[h])
        for t0 in range(0, n, tile_tokens):
            t1 = min(t0 + tile_tokens, n)
            r = (t1 - t0) * group
            # rows (token, group head), scaled: one new contiguous array (never a view of the query)
            q = (query[start + t0:start + t1, heads] * q_scale).reshape(r, head_dim)
            matmul_into(q, k_h, s[:r])
            _SOFTMAX(s[:r], first_pos + t0, group, inv_den[:r])
            matmul_into(s[:r], v_h, pv[:r])
            o = pv[:r, :head_dim]
            o *= inv_den[:r, None]
            out[start + t0:start + t1, heads] = o.reshape(t1 - t0, group, head_dim)


def warm_up() -> None:
    """Compile (or load from the cache) the softmax, the gather, and the GEMM for the argument types
    prefill_sequence passes (numba_gemm.warm_up's: the panels as a read-only weight)."""
    s = np.ones((4, 3), dtype=_F32)
    _SOFTMAX(s[:2], 1, 2, np.empty(2, dtype=_F32))
    cache = np.ones((2, 4, 1, 4), dtype=_F32)
    kp = np.empty((1, 1, 4, PANEL), dtype=_F32)
    vp = np.empty((1, 1, PANEL, PANEL), dtype=_F32)
    _GATHER(cache, cache, np.zeros(2, dtype=np.int32), 5, kp, vp)
    scores = np.empty((2, PANEL), dtype=_F32)
    matmul_into(np.ones((2, 4), dtype=_F32), _as_weight(kp[0]), scores[:2])
    matmul_into(scores[:2], _as_weight(vp[0]), np.empty((2, PANEL), dtype=_F32))
