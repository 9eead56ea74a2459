"""Long prefill chunks for the numba set's paged attention: Q.K^T and P.V through numba_gemm's register-
tiled kernel, the masked softmax between them, all three on one core's tile of query rows at a time. Same
result as paged_attention.paged_attention (the numpy reference) within float32 rounding;
tests/cupy_kernels/test_numba_prefill.py compares them.

Why a second path: a chunk of n query tokens against L keys is two matmuls of n*G x 64 x L per kv head
(G query heads share a kv head). At n = 240, L = 4,000 (bench/jitter.py's last chunks) numba_attention's
loop nest, built for decodes (one row per key, reading K/V in place), ran at ~40 GFLOP/s.

A group of sequences' keys and values (up to GROUP_KEYS keys: a step's 16 prompts of 128 tokens; a longer
sequence alone) are first copied out of their blocks into the GEMM's panel layout (once per layer: ~1 ms at
4,000 keys). Then each work item (a sequence's kv head h and tile of TILE_TOKENS query tokens: its
TILE_TOKENS x G rows) runs on one core, in one `prange` over the group taken dynamically (the costliest
sequence first; head by head, each head's costliest tiles first). One gather and one pass a group instead of
one each a sequence: 16 prompts of 128 tokens 2.95-3.15 -> 2.71-2.83 ms a layer, beside 128 decodes
4.50-4.59 -> 3.87-4.17 (2 threads, the test VM).

    S = Q_tile . K_h^T                      over the key panels the tile's last token sees (none past it)
    P = 2^(S - rowmax) on keys <= the row's position, 0 past it; l = row sum     (Q pre-scaled by
                                                                                   scale * log2(e))
    out rows = (P . V_h) / l                over the keys the tile's last token sees

A tile's scores ([48, 4,000] floats, 768 KB, for SmolLM2 at 4,000 keys) stay in that core's L2 cache through
the three steps, in the core's own workspace. The path before took each step over a whole kv head's rows
with the GEMM's threads sharing the columns, so the softmax and P.V read half of each score row from the other
core's cache, and it computed the whole n x L rectangle (the masked half of a prompt's own keys included):
one layer, 240 new tokens over 4,000 keys, 2 threads, 26.7-30.2 against 17.7-24.2 ms now, and a 2,048-token
prompt 88.6-95.7 against 36.0-52.1 ms (docs/benchmarks.md has the measurements). The bits did not change:
each output is the GEMM's one FMA chain in k order whatever the tile, and a masked score is an exact 0 (an
FMA with it adds nothing).

A row's result depends only on its own sequence and position (never on the batch or the tile): batch
invariance holds. It is not the same arithmetic as numba_attention's loop nest, so a prompt computed in one
chunk and in several chunks (some taking the other path) may differ in the last bits; set
PAGEDSERVE_BATCH_INVARIANT=1 to run every chunk through the loop nest (slower long prefills).
"""

from __future__ import annotations

import threading

import numpy as np

from . import launch
from .gemm import PANEL, panel_rows_address
from .numerics import exp2_sum, row_max
from .setup import JIT, JIT_EXACT, apply_threads, call_compiled, numba

# A sequence's chunk takes this path when it has at least MIN_TOKENS new tokens and the loop nest would cost
# more. The loop nest computes the (query token, key) pairs a token sees, n (L - (n - 1) / 2) for n new tokens
# over a context of L; this path the same pairs and, in each tile, the masked triangle of the tile's own keys
# (about n (min(n, TILE_TOKENS) - 1) / 2 more), at twice the rate, plus a cost per sequence (the gather, a
# parallel call). Measured on 2 cores with SmolLM2's shapes (bench/attention_paths.py, docs/benchmarks.md,
# 2026-12-01): a 2,048-token prompt 73.9 ms a layer in the loop nest against 37.1 here, 1,024 17.0 / 8.8, 240
# new over 4,000 keys ~44 / ~19; near the break-even, 16 prompts of 128 tokens 7.3 / 5.7 ms, 16 chunks of 64
# over 128 keys 3.7 / 3.8, 16 chunks of 32 over 128 keys 2.6 / 4.0 (~0.1 ms a sequence here).
MIN_TOKENS = 16
LOOP_NEST_PAIR_COST = 2.0  # a seen pair in the loop nest, in pairs of this path
MATMUL_FIXED_PAIRS = 6_000  # this path's cost per sequence, in its pairs
# Query tokens per work item: their TILE_TOKENS x G score rows (G query heads per kv head) stay in one core's L2
# cache through Q.K^T, the softmax and P.V. 240 new over 4,000 keys, one layer, 2 threads (ms): 8 tokens 13.5,
# 16: 13.8, 32: 12.9, 48: 15.6, 80: 16.7 (the host's noise is ~10%); 16 makes 45 items of SmolLM2's 240-token
# chunks for the two threads to share out. Long contexts keep the 16 (a thread's scores: 6 MB at 32,768 keys):
# tiles cut to 1 MB of scores were slower (256 new over 32,768 keys 148-153 against 254-260 ms a layer; over
# 8,192 keys 25-34 against 30-36). A workspace per thread, TILE_TOKENS x G x L floats each: counted in
# runtime/worker/memory_budget.py (PREFILL_TILE_TOKENS, which must equal this).
TILE_TOKENS = 16
# Keys (summed over a group's sequences) whose panels one gather holds: a step's 16 prompts of 128 tokens in one
# group. A longer sequence is a group of its own. Counted in runtime/worker/memory_budget.py (PREFILL_GROUP_KEYS).
GROUP_KEYS = 2048
_F32 = np.dtype(np.float32)
LOG2_E = 1.4426950408889634


def takes_matmul_path(num_new: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Which sequences of a batch this path computes, by their own sizes only (never the batch's): chunks of
    at least MIN_TOKENS new tokens whose seen pairs would cost the loop nest more than this path's pairs."""
    seen = num_new * (seq_lens - (num_new - 1) / 2)
    computed = seen + num_new * (np.minimum(num_new, TILE_TOKENS) - 1) / 2
    return (num_new >= MIN_TOKENS) & (LOOP_NEST_PAIR_COST * seen > computed + MATMUL_FIXED_PAIRS)


@numba.njit(inline="always", **JIT_EXACT)
def _gather_panel(c, k_cache, v_cache, block_table, key_start, context_len, kp, vp):
    """Panel c of the sequence's keys and values from position key_start (0, or the oldest key a sliding
    window lets the chunk's first token see), out of its blocks, in numba_gemm's panel layout (P = PANEL):
    kp[h, c, d, j] = K[h, key_start + c P + j, d] (the keys as a [L, D] weight: S = Q . K^T), and the same
    keys' rows of vp[h, cv, p, j] = V[h, key_start + p, cv P + j] (the values as a [D, L] weight: O = P . V);
    positions past context_len and head dims past D are zero (a score there is masked to 0, and 0 * garbage
    could be NaN)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    panel = kp.shape[3]
    for j in range(panel):
        p = c * panel + j
        inside = key_start + p < context_len
        block = block_table[(key_start + p) // block_size] if inside else 0
        i = (key_start + p) % block_size
        for h in range(num_kv_heads):
            for d in range(head_dim):
                kp[h, c, d, j] = k_cache[block, i, h, d] if inside else np.float32(0.0)
            for cv in range(vp.shape[1]):
                for jv in range(panel):
                    d = cv * panel + jv
                    vp[h, cv, p, jv] = v_cache[block, i, h, d] if inside and d < head_dim else np.float32(0.0)


# A call's sequences, one row each of the int64 table `meta` (_plan): the sequence, its first query row, new
# tokens, the first query token's position less key_start, key_start, context length, key panels, where its
# key and value panels start in the workspace, and the tile's query tokens.
_SEQ, _START, _NEW, _FIRST, _KEY_START, _CONTEXT, _PANELS, _K_AT, _V_AT, _TILE = range(10)


@numba.njit(inline="always", **JIT_EXACT)
def _views(kv, meta, j, num_kv_heads, head_dim, value_panels):
    """Sequence j's key and value panels in the flat workspace kv (the shapes _gather_panel fills)."""
    panels = meta[j, _PANELS]
    k_at, v_at = meta[j, _K_AT], meta[j, _V_AT]
    kp = kv[k_at:k_at + num_kv_heads * panels * head_dim * PANEL].reshape((num_kv_heads, panels, head_dim, PANEL))
    vp = kv[v_at:v_at + num_kv_heads * value_panels * panels * PANEL * PANEL].reshape(
        (num_kv_heads, value_panels, panels * PANEL, PANEL))
    return kp, vp


def _gather_task(x, words):
    """Task x = (sequence j, panel c) of `tasks`: _gather_panel, run by launch.py's one prange (a prange of its
    own around a call by address compiled in 0.7 s). Packed by prefill_batch: k_cache, v_cache, int32
    block_tables, meta, tasks, kv, value_panels."""
    k_cache = launch.array4(words, 0, np.float32)
    v_cache = launch.array4(words, 5, np.float32)
    block_tables = launch.array2(words, 10, np.int32)
    meta = launch.array2(words, 13, np.int64)
    tasks = launch.array2(words, 16, np.int64)
    kv = launch.array1(words, 19, np.float32)
    j = tasks[x, 0]
    kp, vp = _views(kv, meta, j, k_cache.shape[2], k_cache.shape[3], words[21])
    _gather_panel(tasks[x, 1], k_cache, v_cache, block_tables[meta[j, _SEQ]], meta[j, _KEY_START],
                  meta[j, _CONTEXT], kp, vp)


_GATHER = numba.njit(**JIT_EXACT)(_gather_task)


_local = threading.local()


def _buffer(name: str, size: int) -> np.ndarray:
    """A float32 buffer of at least `size`, kept per thread and grown as needed."""
    buf = getattr(_local, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(max(size, 2 * buf.size if buf is not None else 0), dtype=_F32)
        setattr(_local, name, buf)
    return buf


def _workspace(panel_floats: int, rows: int, padded: int, width: int, head_dim: int, threads: int):
    """The key and value panels of a call's sequences (flat), and each numba thread's rows: scaled queries [rows *
    head_dim], scores [rows * padded context], P.V's output [rows * padded head dim] and row factors [rows];
    views of buffers kept per (calling) thread, with a slot for each of the `threads` the call runs on
    (numba.get_thread_id is below numba.get_num_threads()), so a host running fewer threads than numba's pool
    holds no more. Fresh multi-megabyte arrays each layer cost more than the copy itself: the allocator hands
    them out as new pages, and first-touch page faults ran at ~2.5 s per GiB on the test VM (3 ms of a 12 ms
    layer at 4,000 keys)."""
    return (_buffer("kv", panel_floats)[:panel_floats],
            _buffer("queries", threads * rows * head_dim)[:threads * rows * head_dim].reshape(threads, rows * head_dim),
            _buffer("scores", threads * rows * padded)[:threads * rows * padded].reshape(threads, rows * padded),
            _buffer("outputs", threads * rows * width)[:threads * rows * width].reshape(threads, rows * width),
            _buffer("factors", threads * rows)[:threads * rows].reshape(threads, rows))


@numba.njit(inline="always", **JIT)
def _prefill_item(w, panel_rows, query, start, n, first_pos, window, kp, vp, q_scale, tile_tokens, q, s, pv, den,
                  out):
    """Work item w: kv head w // tiles, its tile of query tokens w % tiles from the chunk's end (the costliest
    first), with this thread's rows q, s, pv, den. first_pos: the position of the chunk's first token less the
    panels' first key position (key_start); window: the sliding window, 0 for none (with one, the tile starts
    at the panel of the oldest key its first token sees, and a row weighs keys older than its window 0).
    panel_rows: the address of numba_gemm.PANEL_ROWS. Items of
    one head in a row share its key and value panels in the caches: with the heads taken in turn instead, a
    layer of a 4,000-token prompt took 207-213 ms against 163-166 (2,048 tokens: 55-56 against 44)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, key_panels, value_panels = kp.shape[0], kp.shape[1], vp.shape[1]
    group = num_heads // num_kv_heads
    padded, width = key_panels * PANEL, value_panels * PANEL
    k_flat, v_flat, s_flat = kp.reshape(kp.size), vp.reshape(vp.size), s.reshape(s.size)
    tiles = (n + tile_tokens - 1) // tile_tokens
    h = w // tiles
    t0 = (tiles - 1 - w % tiles) * tile_tokens
    t1 = min(t0 + tile_tokens, n)
    rows = (t1 - t0) * group
    keys = first_pos + t1  # the keys the tile's last token sees
    p0 = max(0, first_pos + t0 - window + 1) // PANEL if window > 0 else 0  # the tile's first panel
    zero = np.int64(0)
    for r in range(rows):  # rows (token, group head), scaled
        for d in range(head_dim):
            q[r * head_dim + d] = query[start + t0 + r // group, h * group + r % group, d] * q_scale
    for p in range(p0, (keys + PANEL - 1) // PANEL):  # S = Q . K^T, a panel of PANEL keys at a time
        call_compiled(panel_rows, (q, zero, head_dim, rows, k_flat, (h * key_panels + p) * head_dim * PANEL, head_dim,
                                   s_flat, p * PANEL, padded, zero))
    for r in range(rows):
        row = s[r]
        seen = first_pos + t0 + r // group + 1
        lo = max(p0 * PANEL, seen - window) if window > 0 else 0  # keys before lo weigh exactly 0
        for j in range(p0 * PANEL, lo):
            row[j] = 0.0
        m = row_max(row[lo:], seen - lo)
        total = exp2_sum(row[lo:seen], seen - lo, m)
        for j in range(seen, keys):
            row[j] = 0.0
        den[r] = np.float32(1.0) / total
    for c in range(value_panels):  # P . V over the keys the tile sees, PANEL head dims at a time
        call_compiled(panel_rows, (s_flat, p0 * PANEL, padded, rows, v_flat,
                                   ((h * value_panels + c) * padded + p0 * PANEL) * PANEL, keys - p0 * PANEL, pv,
                                   c * PANEL, width, zero))
    for r in range(rows):
        inv = den[r]
        for d in range(head_dim):
            out[start + t0 + r // group, h * group + r % group, d] = pv[r * width + d] * inv


def _prefill_task(x, words):
    """Work item x = (sequence j, item w) of `work`: _prefill_item with this thread's rows, run by launch.py's one
    prange (a prange of its own around a call by address compiled in 1.1 s). Packed by prefill_batch: query,
    meta, work, window, kv, num_kv_heads, value_panels, q_scale, qs, ss, pvs, dens, out, PANEL_ROWS' address."""
    query = launch.array3(words, 0, np.float32)
    meta = launch.array2(words, 4, np.int64)
    work = launch.array2(words, 7, np.int64)
    kv = launch.array1(words, 11, np.float32)
    num_kv_heads, value_panels = words[13], words[14]
    qs, ss = launch.array2(words, 16, np.float32), launch.array2(words, 19, np.float32)
    pvs, dens = launch.array2(words, 22, np.float32), launch.array2(words, 25, np.float32)
    out = launch.array3(words, 28, np.float32)
    j, w = work[x, 0], work[x, 1]
    kp, vp = _views(kv, meta, j, num_kv_heads, query.shape[2], value_panels)
    t = numba.get_thread_id()
    rows, padded = meta[j, _TILE] * (query.shape[1] // num_kv_heads), meta[j, _PANELS] * PANEL
    _prefill_item(w, words[32], query, meta[j, _START], meta[j, _NEW], meta[j, _FIRST], words[10], kp, vp,
                  np.float32(launch.float_at(words, 15)), meta[j, _TILE], qs[t], ss[t, :rows * padded].reshape(
                      (rows, padded)), pvs[t], dens[t], out)


_ITEMS = numba.njit(**JIT)(_prefill_task)


def _groups(seqs, query_start_loc, seq_lens, window: int):
    """The sequences' metadata (numpy, each a row of _plan's table), costliest first, cut into groups of at most
    GROUP_KEYS keys (or one sequence, if it has more): a call gathers one group's panels at once."""
    start = query_start_loc[seqs]
    new = query_start_loc[seqs + 1] - start
    context = seq_lens[seqs]
    key_start = np.maximum(0, context - new - window + 1) if window > 0 else np.zeros_like(context)
    panels = -(-(context - key_start) // PANEL)
    order = np.argsort(-(new * (context - (new - 1) / 2)), kind="stable")
    groups, first, keys = [], 0, 0
    for x, i in enumerate(order):
        if x > first and keys + panels[i] * PANEL > GROUP_KEYS:
            groups.append(order[first:x])
            first, keys = x, 0
        keys += panels[i] * PANEL
    groups.append(order[first:])
    return [(seqs[g], start[g], new[g], context[g], key_start[g], panels[g]) for g in groups]


def _plan(group, num_kv_heads: int, head_dim: int, value_panels: int, tile_tokens: int):
    """(meta, gather tasks, work items, panel floats) of one group (_groups)."""
    seqs, start, new, context, key_start, panels = group
    tile = np.clip(new, 1, tile_tokens)
    k_size = num_kv_heads * panels * head_dim * PANEL
    v_size = num_kv_heads * value_panels * panels * PANEL * PANEL
    at = np.zeros(seqs.size + 1, dtype=np.int64)
    np.cumsum(k_size + v_size, out=at[1:])
    meta = np.stack([seqs, start, new, context - new - key_start, key_start, context, panels, at[:-1],
                     at[:-1] + k_size, tile], axis=1).astype(np.int64)
    tasks = _pairs(panels)
    work = _pairs(num_kv_heads * -(-new // tile))
    return meta, tasks, work, int(at[-1])


def _pairs(counts):
    """[(j, c) for j, n in enumerate(counts) for c in range(n)] as an int64 [sum(counts), 2] array."""
    j = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    ends = np.cumsum(counts)
    return np.stack([j, np.arange(j.size, dtype=np.int64) - np.repeat(ends - counts, counts)], axis=1)


def prefill_batch(query, k_cache, v_cache, seqs, query_start_loc, seq_lens, block_tables, scale: float, out,
                  window: int = 0, plans: dict | None = None) -> None:
    """out rows of sequences `seqs` (the batch's indices: checked metadata, int64) = attention of their new
    tokens (the last of their seq_lens positions) over their contexts, causal within the chunk; with a sliding
    window (window > 0), over the keys from the oldest the chunk's first token sees (none before it is read).
    One parallel gather and one parallel pass over the work items per group of sequences (_groups): 16 prompts of
    128 tokens, one call each, had cost two thread-pool wake-ups and the Python around them per sequence.
    plans: a dict the caller keeps for one step's metadata (AttentionPlan.prefill_plans), where the groups' work
    is cut once for all of the step's layers instead of once a layer."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    query = np.ascontiguousarray(query)  # launch.pack's arrays: C-contiguous, block tables int32
    block_tables = np.ascontiguousarray(block_tables, dtype=np.int32)
    apply_threads(parallel=True)
    threads = numba.get_num_threads()  # what get_thread_id ranges over, whoever set it
    value_panels = -(-head_dim // PANEL)
    tile_tokens = TILE_TOKENS
    # Scores in log2 units, so the softmax takes 2^x (fast_exp2, cheaper than exp): the same weights.
    q_scale = np.float32(scale * LOG2_E)
    key = (window, num_kv_heads, head_dim, tile_tokens, GROUP_KEYS)
    cut = None if plans is None else plans.get(key)
    if cut is None:
        cut = [_plan(group, num_kv_heads, head_dim, value_panels, tile_tokens)
               for group in _groups(np.asarray(seqs, dtype=np.int64), query_start_loc, seq_lens, window)]
        if plans is not None:
            plans[key] = cut
    for meta, tasks, work, panel_floats in cut:
        rows = int(meta[:, _TILE].max()) * group_size
        kv, qs, ss, pvs, dens = _workspace(panel_floats, rows, int(meta[:, _PANELS].max()) * PANEL,
                                           value_panels * PANEL, head_dim, threads)
        launch.run_items(launch.item_address(_GATHER), tasks.shape[0],
                         launch.pack(k_cache, v_cache, block_tables, meta, tasks, kv, value_panels))
        words = launch.pack(query, meta, work, window, kv, num_kv_heads, value_panels, float(q_scale), qs, ss, pvs,
                            dens, out, panel_rows_address())
        with numba.parallel_chunksize(1):
            launch.run_items(launch.item_address(_ITEMS), work.shape[0], words)


def warm_up() -> None:
    """Compile (or load from the cache) the gather, the work item, the GEMM's row tiles and the pranges over them
    for the argument types prefill_batch passes."""
    cache = np.ones((2, 4, 1, 4), dtype=_F32)
    query, out = np.ones((3, 2, 4), dtype=_F32), np.empty((3, 2, 4), dtype=_F32)
    prefill_batch(query, cache, cache, np.zeros(1, dtype=np.int64), np.array([0, 3], dtype=np.int64),
                  np.array([5], dtype=np.int64), np.zeros((1, 2), dtype=np.int32), 0.5, out)
