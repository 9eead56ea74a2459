"""Unified paged attention compiled with numba: prefill chunks and decodes in one varlen call, K/V read in
place from the block pool (no gather copy), grouped-query heads packed so a K/V row is read once for its G
query heads. Same signature and result (within float32 rounding) as paged_attention.paged_attention, the
numpy reference it is tested against (tests/cupy_kernels/test_numba_attention.py).

A step's metadata is checked and its work cut into items and chunks once, by plan_attention
(attention_plan.py). Each chunk runs on one thread and allocates its scratch once. An item holds its tile x H
query rows and walks its sequence's blocks in order:

    for each segment of up to K_SEGMENT keys the tile can see (whole blocks):
        S = Q . K^T                     K rows (all kv heads of a token: contiguous) read in order, a run of
                                        RUN keys at a time, used by the G query heads of their kv head;
                                        causal: key pos <= row pos
        m' = max(m, max S); P = exp(S - m'); l = l * exp(m - m') + sum P     (one softmax per segment;
        acc = acc * exp(m - m') + P . V                                       the rescale only past 512 keys)
    out = acc / l

A query row takes a run of RUN keys in one pass over head_dim when it sees them all: the RUN dot products
share each load of q and keep their sums in registers, and its acc row is loaded and stored once per run
instead of once per key (both runs are LLVM vector IR: numba_attention_ir.py); keys past the row's last full
run go one at a time. A decode step reads every sequence's whole context from a pool far larger than the L3
cache, and blocks lie anywhere in it: the rows of the block one ahead in the chunk's reads (the next K block,
the segment's first V block after the last K block, the next item's first K block after the last V block) are
prefetched while a run is computed, a few hints per query head's share of the run, a block's pages at once
(prefetch.py). Inner loops index the arrays directly: a row view (`k_cache[b, j, h]`) costs a
reference-count call each time it is made. A 64-sequence, 192-token decode step over 30 layers takes 29 ms on
one thread (1-thread rates matter: in the engine, OpenBLAS's threads spin after each matmul and hold the second
core; the loop nest's history: docs/notes/kernels.md).

Sliding window (sliding_window=W: a row at p sees keys p - W < k <= p): an item's walk starts at the block of
the oldest key its first row sees, within the segment that holds it (segments keep their fixed positions);
blocks before it are never read. Keys of the blocks read that are older than a row's window weigh exactly 0
(p = 0 on a finite V row), so where an item starts never changes a row's bits.

Prefill chunks of 16 or more tokens where numba_prefill's tiles (Q.K^T, softmax and P.V on one core per tile
of query tokens) cost less than this loop nest (numba_prefill.takes_matmul_path: whole prompts from ~128
tokens, chunks deep in a longer context) are computed there, unless PAGEDSERVE_BATCH_INVARIANT=1; everything
else (decodes, short chunks over short contexts) by this loop nest.

Batch invariance: in the loop nest, a query row's arithmetic (its keys, in order, in segments at fixed
positions, in runs at fixed positions within each block, the single keys after its last full run, and the
fixed vector width of its dot products, in the one loop nest every item runs) depends only on its own
sequence and position: not on the tile it landed in, the other sequences in the batch, whether its prompt
was chunked (a chunk of one token included), or the thread that ran it.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from . import attention_ir as ir_loops
from . import launch
from . import prefetch as hints
from . import prefill
from ..kv_layout import head_dim_of
from ..reference import paged_attention as reference
# The plan, and names tests and benchmarks read from here.
from .attention_plan import (Q_TILE, AttentionPlan, _check_shapes, _cut_work, _scan, _work_items,  # noqa: F401
                             plan_attention)
from .numerics import exp_sum, fast_exp, row_max
from .setup import JIT, apply_threads, numba

K_SEGMENT = 512  # keys whose scores are held at once; softmax is exact within a segment, rescaled across
RUN = ir_loops.RUN  # keys per run in _scores and _accumulate (written out for 8, the fastest of 4, 8 and 16)
PREFETCH_BLOCKS = 1  # blocks ahead of the one being read whose rows are prefetched (more were no faster)
_F32 = np.dtype(np.float32)
# What the loop nest reads the caches as, and a value's bytes (the prefetch hints count 4-byte units): float32
# here; attention16.py compiles the same loop nest with uint16 caches (bfloat16's or float16's bits).
_KV_STORAGE = np.float32
_KV_BYTES = 4


@numba.njit(inline="always", **JIT)
def _scores(q, s, k_cache, r, block, h, off, j, nv, head_dim):
    """Row r's scores for the keys of `block` (kv head h) from j: s[r, off + jj] = q[r] . K[block, jj, h].
    RUN keys at once (their dot products share each load of q and keep their sums in registers, in vector IR:
    numba_attention_ir.dot_run) when the row sees them all (nv: the keys of the block it sees) and head_dim is
    a multiple of the IR's LANES; else one key at a time up to nv. (No 8-key numba loop for other head dims:
    it lengthened the loop nest's compile; SmolLM2's 64, and 80, 96, 128, 256 are multiples of 16.)"""
    if j + RUN <= nv and head_dim % ir_loops.LANES == 0:
        row_floats = k_cache.shape[2] * head_dim
        key = (block * k_cache.shape[1] + j) * row_floats + h * head_dim
        ir_loops.dot_run(ir_loops.address(q), r * head_dim, ir_loops.address(k_cache), key, row_floats, head_dim,
                         ir_loops.address(s), r * s.shape[1] + off + j)
    else:  # a partial run, or a head_dim the vector runs do not take: key by key
        for jj in range(j, min(nv, j + RUN)):
            dot = np.float32(0.0)
            for d in range(head_dim):
                dot += q[r, d] * k_cache[block, jj, h, d]
            s[r, off + jj] = dot


@numba.njit(inline="always", **JIT)
def _accumulate(s, acc, v_cache, r, block, h, off, j, nv, head_dim):
    """acc[r] += s[r, off + jj] * V[block, jj, h] over the keys from j: RUN of them in one pass over acc[r]
    (numba_attention_ir.axpy_run) when row r sees them all and head_dim is a multiple of the IR's LANES,
    else one at a time up to nv."""
    if j + RUN <= nv and head_dim % ir_loops.LANES == 0:
        row_floats = v_cache.shape[2] * head_dim
        value = (block * v_cache.shape[1] + j) * row_floats + h * head_dim
        ir_loops.axpy_run(ir_loops.address(s), r * s.shape[1] + off + j, ir_loops.address(v_cache), value, row_floats,
                          head_dim, ir_loops.address(acc), r * head_dim)
    else:  # a partial run, or a head_dim the vector runs do not take: key by key
        for jj in range(j, min(nv, j + RUN)):
            p = s[r, off + jj]
            for d in range(head_dim):
                acc[r, d] += p * v_cache[block, jj, h, d]


@numba.njit(inline="always", **JIT)
def _scratch(rows, cols):
    """A float32 [rows, cols] scratch array starting on a cache line: numba's own arrays start on 32 bytes, and
    then every 64-byte load and store of a query or acc row in the vector runs straddled two lines (a
    256-sequence decode step over 30 layers' pools 94.7 / 96.1 -> 93.4 / 94.7 ms; from cache 36.0 / 48.6 ->
    33.2 / 37.1 ms)."""
    buf = np.empty(rows * cols + 16, dtype=np.float32)
    at = (-ir_loops.address(buf) % 64) // 4
    return buf[at:at + rows * cols].reshape((rows, cols))


def _attention_chunk(c, words):
    """Chunk c of the work: its items one after the other. Its arguments (launch.pack): the step's
    query_start_loc, seq_lens, int32 block_tables, items and bounds (AttentionPlan.step_words), then the
    layer's query [T, H, D], caches, out, scale and window (the sliding window, 0: none; _run)."""
    query_start_loc = launch.array1(words, 0, np.int64)
    seq_lens = launch.array1(words, 2, np.int64)
    block_tables = launch.array2(words, 4, np.int32)
    items = launch.array2(words, 7, np.int64)
    bounds = launch.array1(words, 10, np.int64)
    query = launch.array3(words, 12, np.float32)
    k_cache = launch.array4(words, 16, _KV_STORAGE)
    v_cache = launch.array4(words, 21, _KV_STORAGE)
    out = launch.array3(words, 26, np.float32)
    scale = np.float32(launch.float_at(words, 30))
    window = words[31]
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    row_floats = num_kv_heads * k_cache.shape[3] * _KV_BYTES // 4  # a token's row in 4-byte units (the hints)
    segment_blocks = K_SEGMENT // block_size
    k_address, v_address = ir_loops.address(k_cache), ir_loops.address(v_cache)  # for the prefetch hints
    # A run's prefetch hints are issued in num_heads parts (one per query head's work), whole lines each.
    part_floats = (RUN * row_floats + 16 * num_heads - 1) // (16 * num_heads) * 16
    order, page_floats = hints.line_order(block_size * row_floats)  # the lines of a block, its pages at once
    streams = block_size * row_floats // page_floats
    # Scratch for the whole chunk, allocated once: rows are (token, query head) of one item.
    max_rows = 0
    for w in range(bounds[c], bounds[c + 1]):
        max_rows = max(max_rows, (items[w, 2] - items[w, 1]) * num_heads)
    q = _scratch(max_rows, head_dim)
    acc = _scratch(max_rows, head_dim)
    m = np.empty(max_rows, dtype=np.float32)
    den = np.empty(max_rows, dtype=np.float32)
    s = _scratch(max_rows, K_SEGMENT)
    for w in range(bounds[c], bounds[c + 1]):
        seq, t0, t1 = items[w, 0], items[w, 1], items[w, 2]
        start = query_start_loc[seq]
        first_pos = seq_lens[seq] - (query_start_loc[seq + 1] - start)  # position of query token 0
        rows = (t1 - t0) * num_heads
        for r in range(rows):
            for d in range(head_dim):
                q[r, d] = query[start + t0 + r // num_heads, r % num_heads, d] * scale
                acc[r, d] = 0.0
            m[r], den[r] = -np.inf, 0.0
        num_keys = first_pos + t1  # the item's last row sees keys 0 .. first_pos + t1 - 1
        num_blocks = (num_keys + block_size - 1) // block_size
        # With a window, the walk starts at the block of the oldest key the item's first row sees (blocks
        # before it are never read); segments stay at their fixed positions (multiples of K_SEGMENT keys).
        first_block = max(0, first_pos + t0 - window + 1) // block_size if window > 0 else 0
        next_seq, next_first, next_blocks = 0, 0, 0  # the chunk's next item: its sequence and blocks it reads
        if w + 1 < bounds[c + 1]:
            next_seq = items[w + 1, 0]
            next_new = query_start_loc[next_seq + 1] - query_start_loc[next_seq]
            next_keys = seq_lens[next_seq] - next_new + items[w + 1, 2]
            if window > 0:
                next_first = max(0, next_keys - (items[w + 1, 2] - items[w + 1, 1]) - window + 1) // block_size
            next_blocks = min((next_keys + block_size - 1) // block_size - next_first, segment_blocks)
        for b0 in range(first_block // segment_blocks * segment_blocks, num_blocks, segment_blocks):
            b1 = min(b0 + segment_blocks, num_blocks)
            bs0 = max(b0, first_block)  # the segment's first block read
            k0, k1 = b0 * block_size, min(b1 * block_size, num_keys)
            # S = Q . K^T over the segment, a run of RUN keys at a time; key j is seen by tokens
            # t >= j - first_pos (causal). Each K row (all kv heads of a token: contiguous) is read
            # in order; the next block's rows are prefetched as this block's are read.
            for b in range(bs0, b1):
                block, off = block_tables[seq, b], (b - b0) * block_size
                ahead, ahead_address = -1, k_address  # the block PREFETCH_BLOCKS ahead in this chunk's reads
                if b + PREFETCH_BLOCKS < b1:
                    ahead = block_tables[seq, b + PREFETCH_BLOCKS]
                elif b + PREFETCH_BLOCKS - b1 < b1 - bs0:
                    ahead, ahead_address = block_tables[seq, bs0 + b + PREFETCH_BLOCKS - b1], v_address
                n = min(block_size, k1 - k0 - off)
                for j in range(0, n, RUN):
                    for h in range(num_kv_heads):
                        for t in range(max(t0, k0 + off + j - first_pos), t1):
                            nv = min(n, first_pos + t + 1 - k0 - off)  # keys of the block token t sees
                            r0 = (t - t0) * num_heads + h * group
                            for r in range(r0, r0 + group):
                                if t == t1 - 1:  # the last token sees the whole run
                                    part = r - r0 + h * group
                                    if ahead >= 0:
                                        hints.prefetch_part(ahead_address, ahead, j, row_floats, block_size, part,
                                                            part_floats, order)
                                    if j == 0 and part < streams:  # the first line of each page of the block's V
                                        hints.prefetch(v_address, (block * block_size * row_floats
                                                                   + part * page_floats))
                                _scores(q, s, k_cache, r, block, h, off, j, nv, head_dim)
            # Softmax over the segment, rescaling what earlier segments summed (online softmax).
            for r in range(rows):
                seen = min(k1, first_pos + t0 + r // num_heads + 1) - k0
                if seen <= 0:
                    continue
                lo = 0  # the row's first key in the segment: keys older than its window weigh exactly 0
                if window > 0:
                    lo = min(seen, max(0, first_pos + t0 + r // num_heads - window + 1 - k0))
                    for j in range((bs0 - b0) * block_size, lo):
                        s[r, j] = 0.0
                    if lo == seen:  # none of the segment is in the row's window
                        continue
                m_new = max(m[r], row_max(s[r, lo:], seen - lo))  # exact: the same bits as a scalar max
                total = exp_sum(s[r, lo:seen], seen - lo, m_new)
                if m[r] > -np.inf:  # not the first segment: rescale (contexts > K_SEGMENT only)
                    corr = fast_exp(m[r] - m_new)
                    den[r] *= corr
                    for d in range(head_dim):
                        acc[r, d] *= corr
                den[r] += total
                m[r] = m_new
            # acc += P . V over the segment, in the same order.
            for b in range(bs0, b1):
                block, off = block_tables[seq, b], (b - b0) * block_size
                ahead, ahead_address, x = -1, v_address, b + PREFETCH_BLOCKS - b1
                if x < 0:
                    ahead = block_tables[seq, b + PREFETCH_BLOCKS]
                elif b1 < num_blocks:  # the next segment's K
                    ahead, ahead_address = block_tables[seq, min(b1 + x, num_blocks - 1)], k_address
                elif x < next_blocks:  # the K of the chunk's next item
                    ahead, ahead_address = block_tables[next_seq, next_first + x], k_address
                n = min(block_size, k1 - k0 - off)
                for j in range(0, n, RUN):
                    for h in range(num_kv_heads):
                        for t in range(max(t0, k0 + off + j - first_pos), t1):
                            nv = min(n, first_pos + t + 1 - k0 - off)
                            r0 = (t - t0) * num_heads + h * group
                            for r in range(r0, r0 + group):
                                if t == t1 - 1 and ahead >= 0:
                                    hints.prefetch_part(ahead_address, ahead, j, row_floats, block_size,
                                                        r - r0 + h * group, part_floats, order)
                                _accumulate(s, acc, v_cache, r, block, h, off, j, nv, head_dim)
        for r in range(rows):
            inv = np.float32(1.0) / den[r]
            for d in range(head_dim):
                out[start + t0 + r // num_heads, r % num_heads, d] = acc[r, d] * inv


# The chunk is its own (serial) function, run by launch.py's one prange: compiled inside a prange, the loop nest
# went through numba's parfor passes, which took 3x as long to compile for the same machine code loop; called by
# name from a prange, its module was linked into the prange's body and into the parallel kernel, and optimised
# and emitted again in each; a prange of its own around a call by address still compiled in 0.6 s, and the loop
# nest inlined (numba.njit(inline="always")) into a function unpacking the words took 1.6 s more than this (the
# compile times: docs/notes/kernels.md, docs/benchmarks.md).
_ATTENTION = numba.njit(**JIT)(_attention_chunk)


def paged_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float,
                    plan: AttentionPlan | None = None, sliding_window: int | None = None) -> np.ndarray:
    """Unified paged attention over a flat varlen batch: query [T, H, D] -> out [T, H, D] (float32). A cache of
    another dtype, or one that is not C-contiguous (the vector-IR runs address it as one), takes the numpy
    reference. `plan`: plan_attention's for this step's metadata (the model makes one a step, shared by its
    global and local layers); else one is made here. `sliding_window`: None, or W (a query at p sees the keys
    p - W < k <= p; blocks wholly older than its window are never read)."""
    window = reference.check_sliding_window(sliding_window)
    kind, reduced = None, None  # a 16- or 8-bit pool: the loop nest of attention16.py or attention8.py
    if k_cache.dtype != _F32 and query.dtype == _F32:
        from . import attention8, attention16

        kind, reduced = attention16.kind_of(k_cache, v_cache), attention16
        if kind is None:
            kind, reduced = attention8.kind_of(k_cache, v_cache), attention8
    if kind is None and (query.dtype != _F32 or k_cache.dtype != _F32 or v_cache.dtype != _F32
                         or not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous)):
        return reference.paged_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                         sliding_window=sliding_window)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention: the key and value caches {k_cache.shape}, {v_cache.shape} must have one "
                         "shape")
    if plan is None:
        plan = plan_attention(query.shape, k_cache.shape, query_start_loc, seq_lens, block_tables, copy=False)
    elif (plan.query_shape != query.shape or plan.pool != k_cache.shape[:2] or plan.sources[0] is not query_start_loc
          or plan.sources[1] is not seq_lens or plan.sources[2] is not block_tables):
        raise ValueError(f"paged_attention: the plan was made for other metadata or shapes (query {plan.query_shape}, "
                         f"pool {plan.pool}; here {query.shape}, {k_cache.shape[:2]})")
    else:
        _check_shapes(query.shape, k_cache.shape)  # each layer's own caches
    if head_dim_of(k_cache) != query.shape[2]:  # (the plan knows shapes, not dtypes: an 8-bit row's scale)
        raise ValueError(f"paged_attention: query {query.shape} does not fit a {k_cache.dtype} cache of "
                         f"{k_cache.shape}")
    query_start_loc, seq_lens, block_tables = plan.query_start_loc, plan.seq_lens, plan.block_tables
    out = np.empty(query.shape, dtype=_F32)
    if query.shape[0] == 0:
        return out
    if plan.long_chunks is not None and kind is not None:  # the long-prefill tiles read float32 panels only
        return reference.paged_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                         sliding_window=sliding_window)
    if plan.long_chunks is not None:
        prefill.prefill_batch(query, k_cache, v_cache, plan.long_seqs, query_start_loc, seq_lens, block_tables, scale,
                              out, window, plan.prefill_plans)
    if plan.items is None:
        return out
    if kind is None:
        _run(plan, np.ascontiguousarray(query), k_cache, v_cache, scale, window, out)
    else:
        stored = attention16.as_bits if reduced is attention16 else reduced.as_bytes
        _run(plan, np.ascontiguousarray(query), stored(k_cache), stored(v_cache), scale, window, out,
             reduced.kernel(kind))
    return out


def _run(plan: AttentionPlan, query, k_cache, v_cache, scale, window, out, kernel=None) -> None:
    """The compiled kernel over the plan's checked metadata and work, on numba's threads when the plan cut it
    into several chunks. Its words: the plan's, then this layer's arrays (~1 us an address: a one-request
    decode step packs 4 a layer). `kernel`: the loop nest compiled for the caches' dtype (None: float32's)."""
    kernel = _ATTENTION if kernel is None else kernel
    words = np.empty(32, dtype=np.int64)
    words[:12] = plan.step_words
    words[12:16] = (query.ctypes.data, *query.shape)
    words[16:26] = _cache_words(k_cache, v_cache)
    words[26:] = (out.ctypes.data, *out.shape, launch.float_word(scale), window)
    if plan.bounds.shape[0] == 2:  # one chunk: on this thread (numba's thread count left as it is)
        kernel(np.int64(0), words)
    else:
        apply_threads(plan.parallel)
        with numba.parallel_chunksize(1):
            launch.run_items(launch.item_address(kernel), plan.bounds.shape[0] - 1, words)


_CACHES: dict = {}  # id(k_cache) -> (weak references to the layer's caches, their words)


def _cache_words(k_cache, v_cache) -> tuple:
    """A layer's caches as words: the same arrays every step, so their addresses are kept (weakly: an engine's
    pool is freed with it) rather than read again (~1 us each, 60 a one-request decode step)."""
    hit = _CACHES.get(id(k_cache))
    if hit is not None and hit[0]() is k_cache and hit[1]() is v_cache:
        return hit[2]
    words = (k_cache.ctypes.data, *k_cache.shape, v_cache.ctypes.data, *v_cache.shape)
    if len(_CACHES) > 4096:  # ids of pools long freed
        _CACHES.clear()
    _CACHES[id(k_cache)] = (weakref.ref(k_cache), weakref.ref(v_cache), words)
    return words


def warm_up() -> None:
    """Compile (or load from the cache) the kernel and the launcher it runs on."""
    cache = np.ones((2, 4, 1, 4), dtype=_F32)
    qsl, lens = np.array([0, 2, 3], dtype=np.int64), np.array([2, 5], dtype=np.int64)
    tables = np.zeros((2, 2), dtype=np.int32)
    for threads in (1, 2):  # one chunk (this thread) and two (the launcher)
        items, bounds = _work_items(qsl, lens, Q_TILE, threads)
        plan = dataclasses.replace(plan_attention((3, 2, 4), cache.shape, qsl, lens, tables), bounds=bounds,
                                   step_words=launch.pack(qsl, lens, tables, items, bounds))
        _run(plan, np.ones((3, 2, 4), _F32), cache, cache, 1.0, 0, np.empty((3, 2, 4), _F32))
