"""Paged KV cache ops: writing new K/V into blocks, copy-on-write block copies, unified paged attention.

KV cache layout, per layer (the contract shared with the CUDA kernels):

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

A sequence's token at position p lives in block `block_table[p // block_size]`, row `p % block_size`;
its flat slot id is `block * block_size + row`. Blocks of one sequence need not be contiguous:

    block_table = [7, 2, 9]      positions 0..15 -> block 7, 16..31 -> block 2, 32..40 -> block 9
    slot of position 35 = 9 * 16 + 3 = 147

The flat batch mixes prefill chunks and decodes. Sequence i owns query rows
query_start_loc[i]:query_start_loc[i+1]; its context (seq_lens[i] tokens, the new ones included) is read
through block_tables[i]. Query row j of a sequence with n new tokens sits at position
seq_len - n + j and sees keys at positions <= its own (causal within the chunk, full over the past).

Sliding window (`sliding_window=W`, a local layer of Gemma 3 or Mistral): a query at position p sees only
the keys k with p - W < k <= p, the W newest (Hugging Face's sliding_window_overlay). Every kernel set starts
its walk over a sequence's blocks at the block holding the oldest key its first query row may see, so the
cost per token is bounded by the window, and blocks wholly older than that are never read (the KV manager
may have given them to another sequence)::

    block_size 4, W = 6, seq_len 15, one decode token at p = 14: sees keys 9..14
    block_table = [7, 2, 9, 5]       block 7 (0..3) never read; 2 (4..7) never read;
                                     9 (8..11) read, key 8 masked; 5 (12..14) read
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..kv_layout import head_dim_of
from . import kv_convert, ops


def reshape_and_cache(
    key: np.ndarray,
    value: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    slot_mapping: np.ndarray,
) -> None:
    """Write key/value [T, KV, D] into the caches at `slot_mapping` [T]; slot -1 means skip. Values are converted to
    the caches' storage dtype (kv_convert.encode: bfloat16 rounded to nearest even, as uint16 bits)."""
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if slots.size and int(slots.max()) >= num_blocks * block_size:
        raise IndexError(f"slot {int(slots.max())} is outside a cache of {num_blocks * block_size} slots")
    k_flat = k_cache.reshape(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.reshape(num_blocks * block_size, *v_cache.shape[2:])
    k_flat[slots] = kv_convert.encode(key[keep], k_cache.dtype)
    v_flat[slots] = kv_convert.encode(value[keep], v_cache.dtype)


def split_qkv(qkv: Any, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[Any, Any, Any]:
    """A qkv projection [T, (H + 2 KV) D] as views query [T, H, D], key and value [T, KV, D]."""
    t, k0, v0 = qkv.shape[0], num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    return (qkv[:, :k0].reshape(t, num_heads, head_dim), qkv[:, k0:v0].reshape(t, num_kv_heads, head_dim),
            qkv[:, v0:].reshape(t, num_kv_heads, head_dim))


def rotary_and_cache(qkv: np.ndarray, num_heads: int, num_kv_heads: int, cos: np.ndarray, sin: np.ndarray,
                     k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping: np.ndarray) -> np.ndarray:
    """A layer's step between its qkv projection [T, (H + 2 KV) D] and its attention: rotate the query and
    key heads by position (ops.apply_rotary), write the rotated key and the value into the caches at
    `slot_mapping` (reshape_and_cache), and return the rotated query [T, H, D]. One op, so a compiled kernel
    set can do it in one call: on the CPU each call costs microseconds of cold caches after a layer's
    weights have streamed through them."""
    return compose_rotary_and_cache(ops.apply_rotary, reshape_and_cache, qkv, num_heads, num_kv_heads, cos, sin,
                                    k_cache, v_cache, slot_mapping)


def linear_rotary_cache(x: np.ndarray, weight_t: Any, num_heads: int, num_kv_heads: int, cos: np.ndarray,
                        sin: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping: np.ndarray,
                        quant: Any = None) -> np.ndarray:
    """rotary_and_cache of the qkv projection ops.linear(x, weight_t): the rotated query [T, H, D] back, the rotated
    key and the value into the caches (KernelSet.linear_rotary_cache: the numba set does it in its GEMM's tiles)."""
    return rotary_and_cache(ops.linear(x, weight_t, quant=quant), num_heads, num_kv_heads, cos, sin, k_cache,
                            v_cache, slot_mapping)


def compose_rotary_and_cache(apply_rotary: Any, write_cache: Any, qkv: Any, num_heads: int, num_kv_heads: int,
                             cos: Any, sin: Any, k_cache: Any, v_cache: Any, slot_mapping: Any) -> Any:
    """rotary_and_cache from a kernel set's own apply_rotary and reshape_and_cache (the numpy and CUDA sets)."""
    if qkv.ndim != 2 or k_cache.ndim != 4 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim_of(k_cache):
        raise ValueError(f"rotary_and_cache: qkv {tuple(qkv.shape)} is not {num_heads} query and {num_kv_heads} kv "
                         f"heads of a cache {tuple(k_cache.shape)}")
    query, key, value = split_qkv(qkv, num_heads, num_kv_heads, head_dim_of(k_cache))
    write_cache(apply_rotary(key, cos, sin), value, k_cache, v_cache, slot_mapping)
    return apply_rotary(query, cos, sin)


def copy_blocks(kv_caches: list[tuple[np.ndarray, np.ndarray]], block_mapping: list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst in every layer's K and V (copy-on-write of a shared block)."""
    if not block_mapping:
        return
    src = np.array([s for s, _ in block_mapping], dtype=np.int64)
    dst = np.array([d for _, d in block_mapping], dtype=np.int64)
    for k_cache, v_cache in kv_caches:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


def check_sliding_window(sliding_window: Any) -> int:
    """The window as an int, 0 for none (None); ValueError naming the field for anything but a positive int."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, (int, np.integer)) or sliding_window <= 0:
        raise ValueError(f"paged_attention: sliding_window must be None or a positive int, got {sliding_window!r}")
    return int(sliding_window)


def window_start(first_pos: Any, window: int) -> Any:
    """The oldest key position a query at `first_pos` sees: 0 without a window (window 0)."""
    return np.maximum(first_pos - window + 1, 0) if window else first_pos * 0


def _gather_context(cache: np.ndarray, block_table: np.ndarray, first_block: int, context_len: int) -> np.ndarray:
    """Token rows first_block * block_size .. context_len - 1 of one sequence, [keys, KV, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    rows = cache[block_table[first_block:num_blocks]]  # [nb, bs, KV, D]
    keys = rows.reshape((num_blocks - first_block) * block_size, *cache.shape[2:])
    return keys[:context_len - first_block * block_size]


def _softmax_rows(scores: np.ndarray) -> np.ndarray:
    """In-place softmax over the last axis (fp32); masked entries are -inf and come out as 0."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def _prefill_one(query, k_cache, v_cache, start, end, context_len, block_table, scale, window, out) -> None:
    """Attention for one sequence's chunk of n > 1 query tokens, causal within the chunk; from the block
    holding the oldest key its first token sees (window 0: from block 0)."""
    n = end - start
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    first_block = int(window_start(context_len - n, window)) // block_size
    k = kv_convert.decode(_gather_context(k_cache, block_table, first_block, context_len))
    v = kv_convert.decode(_gather_context(v_cache, block_table, first_block, context_len))
    num_keys = k.shape[0]
    # [n, KV*G, D] -> [KV, G*n, D]: every query head of a group against its one kv head.
    q = query[start:end].astype(np.float32, copy=False).reshape(n, num_kv_heads, group, head_dim)
    q = q.transpose(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)
    scores = np.matmul(q, k.transpose(1, 2, 0))  # [KV, G*n, L]
    scores *= np.float32(scale)
    q_pos = context_len - n + np.arange(n)
    k_pos = first_block * block_size + np.arange(num_keys)
    hidden = (k_pos[None, :] > q_pos[:, None]) | (k_pos[None, :] < window_start(q_pos, window)[:, None])  # [n, L]
    bias = np.where(hidden, np.float32(-np.inf), np.float32(0.0))
    scores.reshape(num_kv_heads, group, n, num_keys)[...] += bias  # broadcast over heads, in place
    if window:  # the first block's keys older than every row's window: weight 0, whatever they hold
        v = np.where((k_pos < window_start(q_pos[0], window))[:, None, None], np.float32(0.0), v)
    o = np.matmul(_softmax_rows(scores), v.transpose(1, 0, 2))  # [KV, G*n, D]
    out[start:end] = o.reshape(num_kv_heads, group, n, head_dim).transpose(2, 0, 1, 3).reshape(n, num_heads, head_dim)


def _decode_group(query, k_cache, v_cache, rows, seq_lens, block_tables, scale, window, out) -> None:
    """Single-token queries that read the same number of blocks, in one batched matmul.

    Grouping by block count keeps every sequence's arithmetic a function of its own length only
    (padding to the group's block count = padding to its own), so results never depend on the batch.
    Each reads from the block of the oldest key its window holds (block 0 without a window).
    """
    b = len(rows)
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    first = window_start(seq_lens - 1, window) // block_size  # [b]
    nb = int((-(-seq_lens // block_size) - first).max())
    padded = nb * block_size
    tables = np.take_along_axis(block_tables, first[:, None] + np.arange(nb)[None, :], axis=1)  # [b, nb]
    k = kv_convert.decode(k_cache[tables].reshape(b, padded, num_kv_heads, k_cache.shape[3]))
    q = query[rows].astype(np.float32, copy=False).reshape(b, num_kv_heads, group, head_dim)
    scores = np.matmul(q, k.transpose(0, 2, 3, 1))  # [b, KV, G, padded]
    scores *= np.float32(scale)
    k_pos = first[:, None] * block_size + np.arange(padded)[None, :]
    # slots past the context (never written), and keys older than the window
    hidden = (k_pos >= seq_lens[:, None]) | (k_pos < window_start(seq_lens - 1, window)[:, None])
    scores = np.where(hidden[:, None, None, :], np.float32(-np.inf), scores)  # whatever the slot holds
    del k
    v = kv_convert.decode(v_cache[tables].reshape(b, padded, num_kv_heads, v_cache.shape[3]))
    v = np.where(hidden[:, :, None, None], np.float32(0.0), v)  # p = 0 there: 0 * v must be 0, not NaN
    out[rows] = np.matmul(_softmax_rows(scores), v.transpose(0, 2, 1, 3)).reshape(b, num_heads, head_dim)


def plan_attention(query_shape: tuple, cache_shape: tuple, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                   block_tables: np.ndarray) -> None:
    """A kernel set's per-step attention plan: the metadata checked once for all layers and the work cut
    (numba_attention.AttentionPlan), passed to each layer's paged_attention. The reference checks nothing
    ahead and plans nothing: None."""
    return None


def paged_attention(
    query: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    scale: float,
    plan: Any = None,
    sliding_window: int | None = None,
) -> np.ndarray:
    """Unified paged attention over a flat varlen batch: query [T, H, D] -> out [T, H, D]. `plan`: what this
    kernel set's plan_attention returned (None here, and unused). `sliding_window`: None (every key up to the
    query's position) or W (the W newest keys: p - W < k <= p).

    Grouped-query attention: query head h reads kv head h // (H // KV). Prefill chunks are computed one
    sequence at a time; decodes (one query token) are batched by block count. Either way a sequence's
    result depends only on itself, never on what else is in the batch.
    """
    window = check_sliding_window(sliding_window)
    num_tokens, num_heads, head_dim = query.shape
    block_size = k_cache.shape[1]
    out = np.empty((num_tokens, num_heads, head_dim), dtype=np.float32)
    seq_lens = np.asarray(seq_lens).astype(np.int64)
    query_start_loc = np.asarray(query_start_loc)
    num_new = np.diff(query_start_loc)
    decodes = np.flatnonzero(num_new == 1)
    if decodes.size:
        lens = seq_lens[decodes]
        nblocks = -(-lens // block_size) - window_start(lens - 1, window) // block_size  # blocks read
        for nb in np.unique(nblocks):
            seqs = decodes[nblocks == nb]
            _decode_group(query, k_cache, v_cache, query_start_loc[seqs], seq_lens[seqs],
                          np.asarray(block_tables)[seqs], scale, window, out)
    for i in np.flatnonzero(num_new > 1):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        _prefill_one(query, k_cache, v_cache, start, end, int(seq_lens[i]), block_tables[i], scale, window, out)
    return out.astype(query.dtype, copy=False)
