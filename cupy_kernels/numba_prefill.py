"""Long prefill chunks for the numba set's paged attention: Q.K^T and P.V as BLAS matmuls, the masked
softmax between them compiled with numba. Same result as paged_attention.paged_attention (the numpy
reference) within float32 rounding; tests/cupy_kernels/test_numba_prefill.py compares them.

Why a second path: a chunk of n query tokens against L keys is two matmuls of n*G x 64 x L per kv head
(G query heads share a kv head). At n = 240, L = 4,000 (bench/jitter.py's last chunks) numba_attention's
loop nest, built for decodes (one row per key, reading K/V in place), ran at ~40 GFLOP/s: 1.6 s of a
step's attention against ~0.2 s for OpenBLAS at ~360 GFLOP/s. The reference's numpy softmax (five passes
over a [n*G, L] array, numpy's exp) then took twice the matmuls; here it is one pass per row, and rows are
taken a tile at a time so a tile's scores stay in the L3 cache between the three steps.

Per sequence and kv head:

    K_h, V_h = the sequence's L key/value rows of head h, copied out of its blocks ([L, D] each, once)
    for each tile of query rows (token t, group g):
        S = Q_tile . K_h^T                      BLAS
        P = 2^(S - rowmax) on keys <= the row's position, 0 past it; l = row sum     (numba; Q pre-scaled
                                                                by scale * log2(e): S in log2 units)
        out rows = (P . V_h) / l                BLAS

A row's result depends only on its own sequence and position (never on the batch): batch invariance
holds. It is not the same arithmetic as numba_attention's loop nest, so a prompt computed in one chunk
and in several chunks (some taking the other path) may differ in the last bits; set
PAGEDSERVE_BATCH_INVARIANT=1 to run every chunk through the loop nest (slower long prefills).
"""

from __future__ import annotations

import threading

import numpy as np

from .numba_ops import fast_exp2, row_max
from .numba_setup import JIT, JIT_EXACT, apply_threads, numba

# A sequence's chunk takes this path when it has at least MIN_TOKENS new tokens and its (new tokens x
# context) work is at least MIN_WORK: below that the loop nest is as fast (measured on 2 cores, SmolLM2
# shapes, bench/attention_paths.py) and small matmuls only pay BLAS's call and packing overheads.
MIN_TOKENS = 16
MIN_WORK = 16 * 128
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


def takes_blas_path(num_new: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Which sequences of a batch this path computes: long chunks, by their own sizes only."""
    return (num_new >= MIN_TOKENS) & (num_new * seq_lens >= MIN_WORK)


def _gather_heads(cache, block_table, context_len, out):
    """out[h, p] = the sequence's row p of kv head h, for p < context_len: [KV, L, D] contiguous, so each
    head's rows are one plain matrix for BLAS. One pass over the sequence's blocks, in parallel."""
    block_size, num_kv_heads, head_dim = cache.shape[1], cache.shape[2], cache.shape[3]
    num_blocks = (context_len + block_size - 1) // block_size
    for b in numba.prange(num_blocks):
        block = block_table[b]
        for i in range(min(block_size, context_len - b * block_size)):
            p = b * block_size + i
            for h in range(num_kv_heads):
                src, dst = cache[block, i, h], out[h, p]
                for d in range(head_dim):
                    dst[d] = src[d]


_GATHER = numba.njit(parallel=True, **JIT_EXACT)(_gather_heads)


_local = threading.local()


def _buffer(name: str, size: int) -> np.ndarray:
    """A float32 buffer of at least `size`, kept per thread and grown as needed."""
    buf = getattr(_local, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(max(size, 2 * buf.size if buf is not None else 0), dtype=_F32)
        setattr(_local, name, buf)
    return buf


def _workspace(num_kv_heads: int, context_len: int, head_dim: int, rows: int):
    """K and V copies [KV, L, D], scores [rows, L] and row factors, views of buffers kept per thread.
    Fresh multi-megabyte arrays each layer cost more than the copy itself: the allocator hands them out
    as new pages, and first-touch page faults ran at ~2.5 s per GiB on the test VM (3 ms of a 12 ms layer
    at 4,000 keys). The scores get a buffer of their own: numpy's matmul, seeing `out` share a base array
    with an operand, took a path 50x slower than BLAS."""
    kv = num_kv_heads * context_len * head_dim
    k_and_v = _buffer("kv", 2 * kv)
    scores = _buffer("scores", rows * context_len + rows)
    return (k_and_v[:kv].reshape(num_kv_heads, context_len, head_dim),
            k_and_v[kv:2 * kv].reshape(num_kv_heads, context_len, head_dim),
            scores[:rows * context_len].reshape(rows, context_len), scores[rows * context_len:rows * (context_len + 1)])


def prefill_sequence(query, k_cache, v_cache, start: int, end: int, context_len: int, block_table, scale: float,
                     out) -> None:
    """out[start:end] = attention of query rows start:end (the sequence's new tokens, the last of its
    context_len positions) over its context, causal within the chunk."""
    n = end - start
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    first_pos = context_len - n
    # The copies and the softmax run on cpu_threads threads, between BLAS calls. That gains only because
    # OpenBLAS's workers soon sleep after a call (OPENBLAS_THREAD_TIMEOUT=18, cupy_kernels/__init__.py):
    # with its default spin the softmax on two threads ran no faster than on one.
    apply_threads(parallel=True)
    tile_tokens = max(1, min(ROW_TILE, TILE_BYTES // (4 * context_len)) // group)
    rows = tile_tokens * group
    k, v, s, inv_den = _workspace(num_kv_heads, context_len, head_dim, rows)
    # Scores in log2 units, so the softmax takes 2^x (fast_exp2, cheaper than exp): the same weights.
    q_scale = np.float32(scale * LOG2_E)
    _GATHER(k_cache, block_table, context_len, k)
    _GATHER(v_cache, block_table, context_len, v)
    for h in range(num_kv_heads):
        heads = slice(h * group, (h + 1) * group)
        k_h, v_h = k[h], v[h]
        for t0 in range(0, n, tile_tokens):
            t1 = min(t0 + tile_tokens, n)
            r = (t1 - t0) * group
            # rows (token, group head), scaled: one new contiguous array (never a view of the query)
            q = (query[start + t0:start + t1, heads] * q_scale).reshape(r, head_dim)
            np.matmul(q, k_h.T, out=s[:r])
            _SOFTMAX(s[:r], first_pos + t0, group, inv_den[:r])
            o = s[:r] @ v_h
            o *= inv_den[:r, None]
            out[start + t0:start + t1, heads] = o.reshape(t1 - t0, group, head_dim)


def warm_up() -> None:
    """Compile (or load from the cache) the softmax for the argument types prefill_sequence passes."""
    s = np.ones((4, 3), dtype=_F32)
    _SOFTMAX(s[:2], 1, 2, np.empty(2, dtype=_F32))
    cache = np.ones((2, 4, 1, 4), dtype=_F32)
    _GATHER(cache, np.zeros(2, dtype=np.int32), 5, np.empty((1, 5, 4), dtype=_F32))
