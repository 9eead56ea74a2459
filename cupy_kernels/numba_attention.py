"""Unified paged attention compiled with numba: prefill chunks and decodes in one varlen call, K/V read in
place from the block pool (no gather copy), online softmax, grouped-query heads packed so a KV block is
read once per group. Same signature and result (within float32 rounding) as paged_attention.paged_attention,
the numpy reference it is tested against (tests/cupy_kernels/test_numba_attention.py).

Work is cut into items (sequence, kv head, tile of up to Q_TILE query tokens) and the items run in a
`prange`, one item per thread at a time (chunk size 1: prefill tiles cost far more than decodes, so a
static split would leave a thread idle). An item holds its G x tile query rows (G = query heads per kv
head) and walks its sequence's block table:

    for each block b the tile can see:          K/V rows read in place: k_cache[block_table[b], :, h, :]
        S = Q . K^T   [G*tile, block_size]      each K row is used by every query row of the group
        causal mask: key position <= query position (rows past it are simply not computed)
        m' = max(m, max S); P = exp(S - m'); l = l * exp(m - m') + sum P; acc = acc * exp(m - m') + P . V
    out = acc / l

Batch invariance: a query row's arithmetic (its blocks, in order, and the fixed vector width of its dot
products) depends only on its own sequence and position: not on the tile it landed in, the other
sequences in the batch, whether its prompt was chunked, or the thread that ran it.
"""

from __future__ import annotations

import numpy as np

from . import paged_attention as reference
from .numba_ops import fast_exp
from .numba_setup import JIT, apply_threads, numba

Q_TILE = 16  # query tokens per work item: G * Q_TILE rows of accumulators stay in L1/L2
# Below this many multiply-adds (Q.K and P.V together) a call runs on one thread: waking the pool costs more.
PARALLEL_MIN_MACS = 1 << 21
_F32 = np.dtype(np.float32)


@numba.njit(**JIT)
def _work_items(query_start_loc, num_kv_heads, q_tile):
    """[n, 4] int64 rows (sequence, kv head, first token, end token) of each work item, tokens relative to
    the sequence's first query row."""
    num_seqs = query_start_loc.shape[0] - 1
    count = 0
    for i in range(num_seqs):
        n = query_start_loc[i + 1] - query_start_loc[i]
        count += (n + q_tile - 1) // q_tile * num_kv_heads
    items = np.empty((count, 4), dtype=np.int64)
    w = 0
    for i in range(num_seqs):
        n = query_start_loc[i + 1] - query_start_loc[i]
        for h in range(num_kv_heads):
            for t0 in range(0, n, q_tile):
                items[w, 0], items[w, 1], items[w, 2], items[w, 3] = i, h, t0, min(t0 + q_tile, n)
                w += 1
    return items


def _attention_items(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, items, out):
    head_dim = query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    for w in numba.prange(items.shape[0]):
        seq, h, t0, t1 = items[w, 0], items[w, 1], items[w, 2], items[w, 3]
        start = query_start_loc[seq]
        num_new = query_start_loc[seq + 1] - start
        first_pos = seq_lens[seq] - num_new  # position of the sequence's first query token
        rows = (t1 - t0) * group
        q = np.empty((rows, head_dim), dtype=np.float32)
        acc = np.zeros((rows, head_dim), dtype=np.float32)
        m = np.full(rows, -np.inf, dtype=np.float32)
        den = np.zeros(rows, dtype=np.float32)
        s = np.empty(block_size, dtype=np.float32)
        for t in range(t0, t1):
            for g in range(group):
                qr, src = q[(t - t0) * group + g], query[start + t, h * group + g]
                for d in range(head_dim):
                    qr[d] = src[d] * scale
        num_keys = first_pos + t1  # the tile's last row sees keys 0 .. first_pos + t1 - 1
        for b in range((num_keys + block_size - 1) // block_size):
            block = block_tables[seq, b]
            k_blk, v_blk = k_cache[block], v_cache[block]
            p0 = b * block_size
            for r in range(rows):
                visible = min(block_size, first_pos + t0 + r // group + 1 - p0)  # causal: key pos <= query pos
                if visible <= 0:
                    continue
                qr, ar = q[r], acc[r]
                m_new = m[r]
                for j in range(visible):
                    kr = k_blk[j, h]
                    dot = np.float32(0.0)
                    for d in range(head_dim):
                        dot += qr[d] * kr[d]
                    s[j] = dot
                    m_new = max(m_new, dot)
                corr = fast_exp(m[r] - m_new) if m[r] > -np.inf else np.float32(0.0)
                total = np.float32(0.0)
                for j in range(visible):
                    p = fast_exp(s[j] - m_new)
                    s[j] = p
                    total += p
                den[r] = den[r] * corr + total
                m[r] = m_new
                for d in range(head_dim):
                    ar[d] *= corr
                for j in range(visible):
                    p, vr = s[j], v_blk[j, h]
                    for d in range(head_dim):
                        ar[d] += p * vr[d]
        for t in range(t0, t1):
            for g in range(group):
                r = (t - t0) * group + g
                o, ar, inv = out[start + t, h * group + g], acc[r], np.float32(1.0) / den[r]
                for d in range(head_dim):
                    o[d] = ar[d] * inv


_ATTENTION = numba.njit(parallel=True, **JIT)(_attention_items)


def _check(query, k_cache, query_start_loc, seq_lens, block_tables) -> None:
    """What the compiled loop trusts (it reads the pool without bounds checks), checked in O(batch)."""
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"paged_attention: query_start_loc {query_start_loc.shape}, seq_lens {seq_lens.shape} and "
                         f"block_tables {block_tables.shape} disagree on the number of sequences")
    num_new = np.diff(query_start_loc)
    if query_start_loc[0] != 0 or query_start_loc[-1] != query.shape[0] or (num_new < 0).any():
        raise ValueError("paged_attention: query_start_loc must rise from 0 to the number of query tokens")
    if (seq_lens < num_new).any() or (seq_lens > block_tables.shape[1] * k_cache.shape[1]).any():
        raise ValueError("paged_attention: a sequence's context is shorter than its new tokens or longer than "
                         "its block table")
    if query.shape[1] % k_cache.shape[2] or query.shape[2] != k_cache.shape[3]:
        raise ValueError(f"paged_attention: query {query.shape} does not fit a cache of {k_cache.shape}")
    if block_tables.size and (int(block_tables.min()) < 0 or int(block_tables.max()) >= k_cache.shape[0]):
        raise IndexError(f"paged_attention: a block id is outside the pool of {k_cache.shape[0]} blocks")


def paged_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float) -> np.ndarray:
    """Unified paged attention over a flat varlen batch: query [T, H, D] -> out [T, H, D] (float32)."""
    if query.dtype != _F32 or k_cache.dtype != _F32 or v_cache.dtype != _F32:
        return reference.paged_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)
    query_start_loc = np.asarray(query_start_loc, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    block_tables = np.asarray(block_tables)
    _check(query, k_cache, query_start_loc, seq_lens, block_tables)
    num_tokens, num_heads, head_dim = query.shape
    out = np.empty((num_tokens, num_heads, head_dim), dtype=_F32)
    if num_tokens == 0:
        return out
    items = _work_items(query_start_loc, k_cache.shape[2], Q_TILE)
    macs = int(np.dot(seq_lens, np.diff(query_start_loc))) * num_heads * head_dim * 2
    apply_threads(parallel=macs >= PARALLEL_MIN_MACS)
    with numba.parallel_chunksize(1):
        _ATTENTION(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, np.float32(scale), items, out)
    return out


def warm_up() -> None:
    """Compile (or load from the cache) the kernel for the argument types the model passes."""
    cache = np.ones((2, 4, 1, 4), dtype=_F32)
    qsl, lens = np.array([0, 2, 3], dtype=np.int64), np.array([2, 5], dtype=np.int64)
    _ATTENTION(np.ones((3, 2, 4), _F32), cache, cache, qsl, lens, np.zeros((2, 2), dtype=np.int32), np.float32(1.0),
               _work_items(qsl, 1, Q_TILE), np.empty((3, 2, 4), _F32))
