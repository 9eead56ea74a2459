"""A step's plan for the numba paged attention (attention.py): its metadata checked once for every layer of
the model, the sequences numba_prefill's matmul path takes, and the loop nest's work cut for the threads.

Checks: the shapes by batch_checks.check_sequence_count, the values by one compiled pass (_scan: one call
instead of a dozen numpy ones, in a decode step of one sequence), whose failure codes batch_checks.scan_error
turns into the errors every kernel set raises. The compiled loop nest reads the pool without bounds checks and
trusts what was checked here.

Work: items (sequence, tile of up to Q_TILE query tokens: a decode is one item of one token), and
consecutive items cut into CHUNKS_PER_THREAD chunks per thread of about equal cost, which the loop nest's
`prange` takes dynamically (a thread slowed by another process on a shared host takes fewer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import launch, prefill
from . import setup as numba_setup
from ..batch_checks import check_sequence_count, scan_error
from .setup import JIT, JIT_EXACT, apply_threads, numba

Q_TILE = 16  # query tokens per prefill item: its Q_TILE * H score rows share each K/V row read
CHUNKS_PER_THREAD = 4  # work is cut into this many equal-cost chunks per thread, taken dynamically
# Below this many multiply-adds (Q.K and P.V together) a call runs on one thread: waking the pool costs more.
PARALLEL_MIN_MACS = 1 << 21


@numba.njit(**JIT)
def _work_items(query_start_loc, seq_lens, q_tile, num_chunks):
    """Work items (sequence, first token, end token; tokens relative to the sequence's first query row)
    and the bounds of `num_chunks` runs of consecutive items of about equal cost (keys x query rows)."""
    num_seqs = query_start_loc.shape[0] - 1
    count = 0
    for i in range(num_seqs):
        n = query_start_loc[i + 1] - query_start_loc[i]
        count += (n + q_tile - 1) // q_tile
    items = np.empty((count, 3), dtype=np.int64)
    cost = np.empty(count, dtype=np.float64)
    w, total = 0, 0.0
    for i in range(num_seqs):
        n = query_start_loc[i + 1] - query_start_loc[i]
        first_pos = seq_lens[i] - n
        for t0 in range(0, n, q_tile):
            t1 = min(t0 + q_tile, n)
            items[w, 0], items[w, 1], items[w, 2] = i, t0, t1
            cost[w] = (t1 - t0) * (first_pos + (t0 + t1 + 1) / 2.0) + 16.0  # + a fixed cost per item
            total += cost[w]
            w += 1
    num_chunks = max(1, min(num_chunks, count))
    bounds = np.empty(num_chunks + 1, dtype=np.int64)
    bounds[0], c, run = 0, 1, 0.0
    for w in range(count):
        run += cost[w]
        while c < num_chunks and run >= total * c / num_chunks:
            bounds[c] = w + 1
            c += 1
    while c <= num_chunks:
        bounds[c] = count
        c += 1
    return items, bounds


@numba.njit(**JIT_EXACT)
def _scan(query_start_loc, seq_lens, block_tables, num_tokens, num_blocks, block_size):
    """One pass over a batch's metadata: (error code, sum over sequences of context x new tokens, the most
    new tokens of a sequence). Codes (batch_checks.SCAN_*, turned into errors by batch_checks.scan_error):
    1 query_start_loc does not rise from 0 to num_tokens, 2 a context shorter than its new tokens or longer
    than its block table, 3 a block id outside the pool (any column of the table, used or not)."""
    num_seqs = seq_lens.shape[0]
    if query_start_loc[0] != 0 or query_start_loc[num_seqs] != num_tokens:
        return 1, 0, 0
    capacity = block_tables.shape[1] * block_size
    macs, most = 0, 0
    for i in range(num_seqs):
        n = query_start_loc[i + 1] - query_start_loc[i]
        if n < 0:
            return 1, 0, 0
        if seq_lens[i] < n or seq_lens[i] > capacity:
            return 2, 0, 0
        macs += seq_lens[i] * n
        most = max(most, n)
    for i in range(num_seqs):
        for j in range(block_tables.shape[1]):
            if block_tables[i, j] < 0 or block_tables[i, j] >= num_blocks:
                return 3, 0, 0
    return 0, macs, most


def _check_shapes(query_shape, cache_shape) -> None:
    if len(query_shape) != 3 or len(cache_shape) != 4:
        raise ValueError(f"paged_attention: query {tuple(query_shape)} must be [tokens, heads, head_dim] and the "
                         f"caches {tuple(cache_shape)} [blocks, block_size, kv_heads, head_dim]")
    # (an 8-bit cache's rows hold head_dim values and a 4-byte scale; paged_attention checks the dtype)
    if query_shape[1] % cache_shape[2] or query_shape[2] not in (cache_shape[3], cache_shape[3] - 4):
        raise ValueError(f"paged_attention: query {tuple(query_shape)} does not fit a cache of {tuple(cache_shape)}")


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """One step's attention metadata, checked once for all of the model's layers, and the loop nest's work
    cut from it (plan_attention). Without one, paged_attention makes one at each call: in a one-request
    decode step about half of each layer's attention (the checks, the work items, the conversions, in caches
    the layer's weights have just streamed through). It keeps its own copies of the metadata, so arrays
    changed after planning cannot make the loop nest read what was not checked, and it serves only calls
    that pass the same metadata objects and shapes it was made for."""
    sources: tuple  # the caller's query_start_loc, seq_lens and block_tables (identity)
    query_start_loc: np.ndarray  # int64 copies, C-contiguous
    seq_lens: np.ndarray
    block_tables: np.ndarray  # a C-contiguous int32 copy (block ids were checked to lie in the pool)
    query_shape: tuple  # (tokens, heads, head_dim)
    pool: tuple  # (num_blocks, block_size) of the caches it was checked against
    long_chunks: np.ndarray | None  # sequences numba_prefill's matmul path computes; None when none
    parallel: bool  # the loop nest on all threads (numba_setup.apply_threads)
    items: np.ndarray | None  # the loop nest's work: every sequence but the long chunks (None: no work)
    bounds: np.ndarray | None
    long_seqs: np.ndarray | None = None  # np.flatnonzero(long_chunks)
    # numba_prefill's work for the long chunks, cut at the step's first layer (per window) for all of them
    prefill_plans: dict = field(default_factory=dict, repr=False)
    # the loop nest's per-step words (launch.pack: query_start_loc, seq_lens, block_tables, items, bounds),
    # packed once for all of the step's layers (attention._run appends a layer's own)
    step_words: np.ndarray | None = field(default=None, repr=False)


def plan_attention(query_shape, cache_shape, query_start_loc, seq_lens, block_tables, *, copy: bool = True
                   ) -> AttentionPlan:
    """Check a step's metadata against the query and cache shapes (ValueError, or IndexError for a block id
    outside the pool: what the compiled loop, which reads the pool without bounds checks, trusts) and plan
    the work. `copy=False`: paged_attention's own throwaway plan, used at once."""
    _check_shapes(query_shape, cache_shape)
    sources = (query_start_loc, seq_lens, block_tables)
    convert = np.array if copy else np.asarray  # (numpy 1.26 refuses np.array's copy=None)
    qsl = convert(query_start_loc, dtype=np.int64, order="C")
    lens = convert(seq_lens, dtype=np.int64, order="C")
    tables = convert(block_tables, order="C")
    check_sequence_count(qsl, lens, tables, "paged_attention")
    num_tokens, num_heads, head_dim = query_shape
    code, macs, most_new = _scan(qsl, lens, tables, num_tokens, cache_shape[0], cache_shape[1])
    if code:
        raise scan_error(code, cache_shape[0], "paged_attention")
    tables = tables.astype(np.int32, copy=False)  # the kernels' one table type
    # numba_setup.BATCH_INVARIANT: every chunk through the loop nest (a row's arithmetic the same whether its
    # prompt came in one chunk or many); by default long chunks take numba_prefill's matmul path (never one
    # of fewer than its MIN_TOKENS new tokens: a step of decodes skips the test).
    long_chunks = None
    if most_new >= prefill.MIN_TOKENS and not numba_setup.BATCH_INVARIANT:
        chosen = prefill.takes_matmul_path(np.diff(qsl), lens)
        long_chunks = chosen if chosen.any() else None
    parallel, items, bounds = False, None, None
    if long_chunks is None and num_tokens:
        parallel, items, bounds = _cut_work(qsl, lens, int(macs), num_heads, head_dim)
    elif long_chunks is not None and not long_chunks.all():  # the loop nest's share: the other sequences
        rest = np.flatnonzero(~long_chunks)
        new = np.diff(qsl)[rest]
        sub_qsl = np.zeros(rest.size + 1, dtype=np.int64)
        np.cumsum(new, out=sub_qsl[1:])
        parallel, items, bounds = _cut_work(sub_qsl, lens[rest], int(np.dot(lens[rest], new)), num_heads, head_dim)
        items[:, 0] = rest[items[:, 0]]  # back to the batch's sequences (tokens count from a sequence's first row)
        if items.shape[0] == 0:  # the others have no new tokens
            parallel, items, bounds = False, None, None
    return AttentionPlan(sources, qsl, lens, tables, tuple(query_shape), tuple(cache_shape[:2]), long_chunks,
                         parallel, items, bounds, None if long_chunks is None else np.flatnonzero(long_chunks),
                         step_words=None if items is None else launch.pack(qsl, lens, tables, items, bounds))


def _cut_work(query_start_loc, seq_lens, context_macs: int, num_heads: int, head_dim: int):
    """(parallel, items, bounds): whether the loop nest shares the batch over the threads (numba's count is set
    here when it does; a one-thread plan leaves it alone, as its one chunk runs on the calling thread), and its
    work items cut into chunks for them. context_macs: the sum of context x new tokens."""
    parallel = context_macs * num_heads * head_dim * 2 >= PARALLEL_MIN_MACS
    threads = apply_threads(parallel=True) if parallel else 1
    # One thread: one chunk (each chunk allocates its scratch), and no schedule to set (the context ~7 us).
    items, bounds = _work_items(query_start_loc, seq_lens, Q_TILE, threads * CHUNKS_PER_THREAD if threads > 1 else 1)
    return parallel, items, bounds
