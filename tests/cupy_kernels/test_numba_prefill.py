"""The numba set's matmul path for long prefill chunks (cupy_kernels/numba_cpu/prefill.py), and the routing in
numba_attention.paged_attention, against the numpy reference.

Tolerance as in test_numba_attention.py: 8 * (D + L) * eps * max|v| (a D-term dot product per score, an
L-term weighted sum per output; inputs standard normal).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from paged_batches import assert_each_alone_equals_together, make_batch

from pagedserve.cupy_kernels.numba_cpu import attention as na
from pagedserve.cupy_kernels.numba_cpu import setup as numba_setup
from pagedserve.cupy_kernels.numba_cpu import prefill as npf
from pagedserve.cupy_kernels.reference import paged_attention as pa

EPS = np.finfo(np.float32).eps


def close_to_reference(batch, got):
    q, k, v, qsl, lens, tables = batch
    ref = pa.paged_attention(q, k, v, qsl, lens, tables, q.shape[2] ** -0.5)
    tol = 8 * (q.shape[2] + int(lens.max())) * EPS * float(np.abs(v).max())
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol)


def same_bits_near_the_reference(batch, results):
    """Every result (one per setting tried) the first one's bits, and that one close to the reference."""
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])
    close_to_reference(batch, results[0])


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_long_chunks_match_the_reference(group, block_size, monkeypatch):
    """Whole prompts and chunks late in a long context, with row tiles that split the chunk unevenly (all on
    the matmul path, whatever its cost against the loop nest)."""
    monkeypatch.setattr(npf, "LOOP_NEST_PAIR_COST", 100.0)
    rng = np.random.default_rng(group * 10 + block_size)
    seqs = [(300, 300), (700, 45), (460, 133)]
    batch = make_batch(rng, seqs, num_kv=2, group=group, head_dim=64, block_size=block_size)
    assert npf.takes_matmul_path(np.array([n for _, n in seqs]), np.array([L for L, _ in seqs])).all()
    got = na.paged_attention(*batch, 64 ** -0.5)
    close_to_reference(batch, got)


def test_row_tiles_split_a_chunk(monkeypatch):
    """Tiles of TILE_TOKENS tokens counted from the chunk's end, the first one partial: 37 tokens in tiles of 5."""
    monkeypatch.setattr(npf, "TILE_TOKENS", 5)
    rng = np.random.default_rng(3)
    batch = make_batch(rng, [(900, 37)], num_kv=3, group=3, head_dim=64, block_size=16)
    close_to_reference(batch, na.paged_attention(*batch, 0.125))


@pytest.mark.parametrize("seq", [(300, 300), (1000, 64), (200, 200)])
def test_a_rows_bits_do_not_depend_on_its_tile(seq, monkeypatch):
    """Each output is one FMA chain over the keys whatever the tile's height, and a tile computes only the keys
    its last token sees (a masked score is an exact 0): any TILE_TOKENS gives the same bits."""
    rng = np.random.default_rng(seq[1])
    batch = make_batch(rng, [seq], num_kv=3, group=3, head_dim=64, block_size=16)
    results = []
    for tile in (16, 1, 7, 64):
        monkeypatch.setattr(npf, "TILE_TOKENS", tile)
        assert npf.takes_matmul_path(np.array([seq[1]]), np.array([seq[0]])).all()
        results.append(na.paged_attention(*batch, 0.125))
    same_bits_near_the_reference(batch, results)


def test_a_mixed_batch_routes_each_sequence_and_matches():
    """Long chunks, short chunks, decodes and a sequence without new tokens in one call."""
    rng = np.random.default_rng(4)
    seqs = [(40, 1), (1000, 64), (90, 90), (5, 0), (333, 1), (640, 200), (20, 7), (100, 15), (40, 40)]
    batch = make_batch(rng, seqs, num_kv=3, group=3, head_dim=64, block_size=16)
    routed = npf.takes_matmul_path(np.diff(batch[3]), batch[4])
    assert routed.tolist() == [False, True, False, False, False, True, False, False, False]
    close_to_reference(batch, na.paged_attention(*batch, 0.125))


def test_batch_invariant_bit_for_bit_on_both_paths():
    """A sequence's rows are the same bits alone as in a batch, on either path."""
    rng = np.random.default_rng(5)
    seqs = [(800, 120), (40, 1), (300, 300), (2000, 23), (100, 23)]
    batch = make_batch(rng, seqs, num_kv=3, group=3, head_dim=64, block_size=16)
    assert npf.takes_matmul_path(np.diff(batch[3]), batch[4]).tolist() == [True, False, True, True, False]
    assert_each_alone_equals_together(na.paged_attention, batch)


def test_batch_invariant_mode_runs_long_chunks_through_the_loop_nest(monkeypatch):
    """PAGEDSERVE_BATCH_INVARIANT: a long prompt in one chunk is the same bits as in small chunks."""
    rng = np.random.default_rng(6)
    q, k, v, qsl, lens, tables = make_batch(rng, [(400, 400)], num_kv=3, group=3, head_dim=64, block_size=16)
    monkeypatch.setattr(numba_setup, "BATCH_INVARIANT", True)
    whole = na.paged_attention(q, k, v, qsl, lens, tables, 0.125)
    parts = [na.paged_attention(q[s:e], k, v, np.array([0, e - s], np.int32), np.array([e], np.int32), tables, 0.125)
             for s, e in ((0, 30), (30, 31), (31, 400))]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    monkeypatch.setattr(numba_setup, "BATCH_INVARIANT", False)
    close_to_reference((q, k, v, qsl, lens, tables), na.paged_attention(q, k, v, qsl, lens, tables, 0.125))


def test_the_workspace_is_reused_and_grows(monkeypatch):
    monkeypatch.setattr(npf, "_local", threading.local())  # a fresh thread's workspace
    rng = np.random.default_rng(7)
    small = make_batch(rng, [(400, 200)], num_kv=1, group=2, head_dim=64, block_size=16)
    assert npf.takes_matmul_path(np.diff(small[3]), small[4]).all()
    query = small[0].copy()
    close_to_reference(small, na.paged_attention(*small, 0.125))
    np.testing.assert_array_equal(small[0], query)  # one kv head: a tile's rows are a view; never scaled in place
    first = npf._local.scores
    close_to_reference(small, na.paged_attention(*small, 0.125))
    assert npf._local.scores is first
    big = make_batch(rng, [(1500, 100)], num_kv=1, group=2, head_dim=64, block_size=16)
    close_to_reference(big, na.paged_attention(*big, 0.125))
    assert npf._local.scores.size > first.size


def test_the_workspace_holds_a_slot_per_running_thread(monkeypatch):
    """Each numba thread's rows get a slot, for the threads the call runs on (not numba's whole pool); the
    thread count changes no bit."""
    from pagedserve.cupy_kernels.host import blas_threads as bt

    rng = np.random.default_rng(11)
    batch = make_batch(rng, [(400, 200)], num_kv=1, group=2, head_dim=64, block_size=16)
    got = {}
    for threads in (1, 2):
        monkeypatch.setattr(bt, "_cpu_threads", threads)
        monkeypatch.setattr(npf, "_local", threading.local())
        got[threads] = na.paged_attention(*batch, 0.125)
        running = min(threads, numba_setup.numba.config.NUMBA_NUM_THREADS)
        padded = -(-400 // npf.PANEL) * npf.PANEL  # the keys, in whole panels
        assert npf._local.scores.size == running * npf.TILE_TOKENS * 2 * padded  # slots x rows x keys
    np.testing.assert_array_equal(got[1], got[2])
    close_to_reference(batch, got[1])


def test_a_strided_or_read_only_query_cache_or_int64_table_gives_the_same_bits():
    """The kernels take C-contiguous arrays through launch.py's words (one machine code for every caller):
    a strided query is copied, int64 block tables converted, read-only caches read where they are."""
    from pagedserve.cupy_kernels.numba_cpu import launch

    rng = np.random.default_rng(12)
    batch = make_batch(rng, [(300, 150)], num_kv=3, group=3, head_dim=64, block_size=16)
    want = na.paged_attention(*batch, 0.125)
    q = batch[0]
    strided = np.zeros(q.shape[:2] + (2 * q.shape[2],), dtype=np.float32)[..., ::2]
    strided[...] = q
    read_only = q.copy()
    read_only.flags.writeable = False
    for query in (strided, read_only):
        np.testing.assert_array_equal(na.paged_attention(query, *batch[1:], 0.125), want)
    k_read_only, v_read_only = batch[1].copy(), batch[2].copy()
    k_read_only.flags.writeable = v_read_only.flags.writeable = False
    np.testing.assert_array_equal(na.paged_attention(q, k_read_only, v_read_only, *batch[3:], 0.125), want)
    np.testing.assert_array_equal(na.paged_attention(q, *batch[1:5], batch[5].astype(np.int64), 0.125), want)
    assert [len(d.signatures) for d in (npf._ITEMS, npf._GATHER, launch._LAUNCH)] == [1, 1, 1]
    with pytest.raises(ValueError, match="not C-contiguous"):
        launch.pack(strided)


def test_row_max_is_exact_at_every_length_and_alignment():
    """The vector max (llvmlite intrinsic): every length around its lane and chain widths, rows starting
    off a vector boundary, the max in the tail or in any lane, infinities."""
    from pagedserve.cupy_kernels.numba_cpu import ops as numba_ops
    from pagedserve.cupy_kernels.numba_cpu.setup import numba

    @numba.njit
    def row_maxima(s, offset, n, out):
        for r in range(s.shape[0]):
            out[r] = numba_ops.row_max(s[r, offset:offset + n], n)

    rng = np.random.default_rng(3)
    s = rng.standard_normal((64, 300)).astype(np.float32)
    s[5, 7] = np.inf
    s[6, :] = -np.inf
    s[7, 299] = 100.0  # in the scalar tail of the longest rows
    for r in range(8, 64):
        s[r, r + 3] = 50.0 + r  # the max in a different lane and chain on each row
    out = np.empty(64, dtype=np.float32)
    for offset in (0, 1, 3):
        for n in (1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 200, 300 - offset):
            row_maxima(s, offset, n, out)
            np.testing.assert_array_equal(out, s[:, offset:offset + n].max(axis=1), err_msg=f"{offset=} {n=}")


def test_after_the_warm_up_a_prefill_compiles_nothing():
    """The work item, the gather, the GEMM's row tiles and the prange over them: the warm-up compiled them for the
    types the model passes (C-contiguous float32 query, int32 block table)."""
    from pagedserve.cupy_kernels.numba_cpu import gemm as numba_gemm, launch

    npf.warm_up()
    kernels = (npf._ITEMS, npf._GATHER, numba_gemm.PANEL_ROWS, launch._LAUNCH)
    counts = [len(d.signatures) for d in kernels]
    rng = np.random.default_rng(8)
    batch = make_batch(rng, [(500, 100)], num_kv=3, group=3, head_dim=64, block_size=16)
    close_to_reference(batch, na.paged_attention(*batch, 0.125))
    assert [len(d.signatures) for d in kernels] == counts


def test_the_route_weighs_the_loop_nests_pairs_against_this_paths():
    """Where bench/attention_paths.py measured each path faster (docs/benchmarks.md, 2026-12-01, the per-core
    tiles): short prompts and short chunks over short contexts stay in the loop nest (this path's cost per
    sequence dominates); whole prompts from 128 tokens and chunks deep in a context take this path; fewer than
    MIN_TOKENS new tokens never do."""
    loop_nest = [(32, 32), (64, 64), (128, 32), (256, 16), (4000, 8), (100, 15)]
    matmuls = [(128, 128), (512, 512), (2048, 2048), (512, 16), (1024, 64), (4000, 16), (4000, 240)]
    cases = loop_nest + matmuls
    routed = npf.takes_matmul_path(np.array([n for _, n in cases]), np.array([L for L, _ in cases]))
    assert routed.tolist() == [False] * len(loop_nest) + [True] * len(matmuls)


def test_a_groups_rows_are_the_same_bits_however_the_sequences_are_grouped(monkeypatch):
    """prefill_batch gathers the panels of a group of sequences at once (at most GROUP_KEYS keys; a longer one is
    a group of its own): all in one group, one each, or in between, every row has the same bits."""
    monkeypatch.setattr(npf, "LOOP_NEST_PAIR_COST", 100.0)
    rng = np.random.default_rng(8)
    seqs = [(128, 128), (300, 40), (50, 50), (700, 20), (40, 1), (90, 33)]
    batch = make_batch(rng, seqs, num_kv=3, group=3, head_dim=64, block_size=16)
    q, k, v, qsl, lens, tables = batch
    chosen = np.flatnonzero(npf.takes_matmul_path(np.diff(qsl), lens))
    assert chosen.tolist() == [0, 1, 2, 3, 5]
    results = []
    for keys, groups in ((1 << 20, 1), (0, 5), (320, 3)):  # 320: [700], [300], [128, 90, 50]
        monkeypatch.setattr(npf, "GROUP_KEYS", keys)
        assert len(npf._groups(chosen, qsl.astype(np.int64), lens.astype(np.int64), 0)) == groups
        results.append(na.paged_attention(*batch, 0.125))
    same_bits_near_the_reference(batch, results)


def test_long_chunks_beside_sequences_without_new_tokens_leave_the_loop_nest_no_work():
    """Only long chunks have rows: the plan gives the loop nest no work, and the result is the reference's."""
    rng = np.random.default_rng(21)
    batch = make_batch(rng, [(300, 0), (200, 200), (7, 0)], num_kv=3, group=3, head_dim=64, block_size=16)
    q, k, v, qsl, lens, tables = batch
    plan = na.plan_attention(q.shape, k.shape, qsl, lens, tables)
    assert plan.long_chunks.tolist() == [False, True, False] and plan.items is None
    close_to_reference(batch, na.paged_attention(q, k, v, qsl, lens, tables, 0.125, plan=plan))


def test_a_steps_plan_cuts_the_long_chunks_work_once_for_all_its_layers(monkeypatch):
    """The long chunks' groups and work items are cut at the first layer and kept in the step's plan: later
    layers (other caches, the same metadata) reuse them and get what a call without the plan gets."""
    rng = np.random.default_rng(30)
    batch = make_batch(rng, [(128, 128), (300, 40), (40, 1)], num_kv=3, group=3, head_dim=64, block_size=16)
    q, k, v, qsl, lens, tables = batch
    cuts = []
    real = npf._groups
    monkeypatch.setattr(npf, "_groups", lambda *a: cuts.append(1) or real(*a))
    plan = na.plan_attention(q.shape, k.shape, qsl, lens, tables)
    layers = [na.paged_attention(q, k * s, v * s, qsl, lens, tables, 0.125, plan=plan) for s in (1.0, 0.5, 2.0)]
    assert len(cuts) == 1 and len(plan.prefill_plans) == 1
    for s, got in zip((1.0, 0.5, 2.0), layers):
        np.testing.assert_array_equal(got, na.paged_attention(q, k * s, v * s, qsl, lens, tables, 0.125))
