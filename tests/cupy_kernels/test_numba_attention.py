"""numba unified paged attention (cupy_kernels/numba_cpu/attention.py) against the numpy reference.

Tolerance: both compute softmax(q.k * scale) . v in float32. A score carries rounding of a D-term dot
product (relative error up to about D * eps of |q||k| * scale) and each exp/normalisation a few eps; the
output is a convex combination of V rows, so its error is at most about (D + L) * eps * max|v| times the
score magnitude (L = context length: the reference sums L weights). Inputs are standard normal, so
scores stay below ~10 and we allow 8 * (D + L) * eps * max|v|.
"""

from __future__ import annotations

import numpy as np
import pytest
from code_paths import run_as_avx2
from paged_batches import assert_each_alone_equals_together, make_batch

from pagedserve.cupy_kernels.numba_cpu import attention as na
from pagedserve.cupy_kernels.numba_cpu import attention_plan, prefill
from pagedserve.cupy_kernels.numba_cpu import setup as numba_setup
from pagedserve.cupy_kernels.reference import paged_attention as pa
from pagedserve.cupy_kernels.numba_cpu.attention_ir import LANES

EPS = np.finfo(np.float32).eps


def check(q, k, v, qsl, lens, tables):
    scale = q.shape[2] ** -0.5
    got = na.paged_attention(q, k, v, qsl, lens, tables, scale)
    ref = pa.paged_attention(q, k, v, qsl, lens, tables, scale)
    assert got.shape == ref.shape and got.dtype == np.float32
    longest = int(lens.max()) if lens.size else 0
    tol = 8 * (q.shape[2] + longest) * EPS * float(np.abs(v).max())
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol)
    return got


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_random_mixed_batches(group, block_size):
    rng = np.random.default_rng(group * 100 + block_size)
    for _ in range(3):
        seqs = []
        for _ in range(int(rng.integers(1, 6))):
            L = int(rng.integers(1, 150))
            kind = rng.integers(0, 3)
            n = 1 if kind == 0 else L if kind == 1 else int(rng.integers(1, L + 1))  # decode, prompt, chunk
            seqs.append((L, n))
        check(*make_batch(rng, seqs, num_kv=int(rng.integers(1, 4)), group=group, head_dim=64,
                          block_size=block_size))


@pytest.mark.parametrize("head_dim", [LANES // 2, LANES, LANES * 3 // 2, 128])
def test_head_dims_on_both_inner_loops(head_dim):
    """Runs of keys take the vector-IR loops (numba_attention_ir) when head_dim is a multiple of its LANES
    (16 with AVX-512, 8 without) and go key by key otherwise (LANES / 2 and 1.5 LANES): both against the
    reference, and a decode row the same bits alone as in a batch."""
    rng = np.random.default_rng(head_dim)
    seqs = [(70, 1), (45, 45), (100, 9), (9, 1)]
    check(*make_batch(rng, seqs, num_kv=2, group=3, head_dim=head_dim, block_size=16))
    assert_each_alone_equals_together(na.paged_attention, make_batch(rng, seqs, 2, 3, head_dim, 16))


def test_a_cache_that_is_not_c_contiguous_takes_the_reference():
    """The vector-IR runs read the pool by address as a C-contiguous array; a strided view of one (every
    other block) is still attended right, by the numpy reference."""
    rng = np.random.default_rng(21)
    q, k, v, qsl, lens, tables = make_batch(rng, [(40, 1), (23, 5)], 2, 3, 64, 16)
    wide_k = np.zeros((2 * k.shape[0],) + k.shape[1:], np.float32)
    wide_v = np.zeros_like(wide_k)
    wide_k[::2], wide_v[::2] = k, v
    strided_k, strided_v = wide_k[::2], wide_v[::2]
    assert not strided_k.flags.c_contiguous
    got = na.paged_attention(q, strided_k, strided_v, qsl, lens, tables, 0.125)
    np.testing.assert_array_equal(got, pa.paged_attention(q, k, v, qsl, lens, tables, 0.125))


@pytest.mark.parametrize("block_floats, pages", [(16 * 3 * 64, 3), (16 * 8 * 128, 16), (16 * 1 * 40, 0)])
def test_prefetch_line_order_takes_a_blocks_pages_at_once(block_floats, pages):
    """The hints ask for every line of a block once; a block of whole 4 KB pages line k of each page before
    line k + 1 of any (each page's lines in order); any other block in order."""
    from pagedserve.cupy_kernels.numba_cpu import prefetch

    order, page_floats = prefetch.line_order(block_floats)
    assert sorted(order.tolist()) == list(range(0, block_floats, 16))
    if not pages:
        assert order.tolist() == list(range(0, block_floats, 16)) and page_floats == block_floats
        return
    assert page_floats == 1024
    assert order[:pages].tolist() == [p * 1024 for p in range(pages)]
    for p in range(pages):
        in_page = order[(order >= p * 1024) & (order < (p + 1) * 1024)]
        assert in_page.tolist() == list(range(p * 1024, (p + 1) * 1024, 16))


AVX2_CHECK = """
import numpy as np
from paged_batches import make_batch
from pagedserve.cupy_kernels.numba_cpu import attention as na, attention_ir as numba_attention_ir
from pagedserve.cupy_kernels.reference import paged_attention as pa
assert numba_attention_ir.LANES == 8, numba_attention_ir.LANES
rng = np.random.default_rng(0)
for head_dim in (8, 64, 12):  # runs as 8 or 1 vector pieces; 12: key by key
    q, k, v, qsl, lens, tables = make_batch(rng, [(70, 1), (45, 45), (600, 3)], 2, 3, head_dim, 16)
    got = na.paged_attention(q, k, v, qsl, lens, tables, 0.125)
    ref = pa.paged_attention(q, k, v, qsl, lens, tables, 0.125)
    tol = 8 * (head_dim + 600) * np.finfo(np.float32).eps * float(np.abs(v).max())
    assert np.abs(got - ref).max() <= tol, (head_dim, float(np.abs(got - ref).max()), tol)
print("OK")
"""


def test_without_avx512_the_runs_take_8_lane_pieces(tmp_path):
    """AVX2 code (NUMBA_CPU_FEATURES without AVX-512) cuts head_dim into 8-float pieces (8 keys' 16-lane
    sums would take all 16 of its registers); results stay right."""
    proc = run_as_avx2(AVX2_CHECK, tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-2000:]


def test_chunk_and_tile_boundaries():
    """Chunks ending exactly on, just before and just after block and query-tile (Q_TILE) boundaries."""
    rng = np.random.default_rng(7)
    t = na.Q_TILE
    seqs = [(16, 16), (17, 1), (33, 17), (48, t), (49, t + 1), (64, t - 1), (31, 31), (32, 2 * t)]
    check(*make_batch(rng, seqs, num_kv=2, group=3, head_dim=64, block_size=16))


@pytest.mark.parametrize("block_size", [8, 32])
def test_contexts_longer_than_a_segment(block_size):
    """Scores are held K_SEGMENT keys at a time and rescaled across segments: decodes and chunks whose
    keys end on, just past and well past segment boundaries, and chunks that straddle one."""
    rng = np.random.default_rng(12 + block_size)
    seg = na.K_SEGMENT
    seqs = [(seg, 1), (seg + 1, 1), (2 * seg + 37, 1), (seg + 20, 40), (seg, seg), (2 * seg + 5, 3)]
    check(*make_batch(rng, seqs, num_kv=2, group=3, head_dim=64, block_size=block_size))


def test_empty_batches_and_sequences_without_new_tokens():
    rng = np.random.default_rng(8)
    q, k, v, qsl, lens, tables = make_batch(rng, [(5, 1)], 1, 2, 64, 8)
    out = na.paged_attention(q[:0], k, v, np.zeros(1, np.int32), np.zeros(0, np.int32),
                             np.zeros((0, 1), np.int32), 0.125)
    assert out.shape == (0, 2, 64)
    check(*make_batch(rng, [(5, 0), (9, 3), (4, 0)], 1, 2, 64, 8))


def test_batch_invariant_and_chunking_invariant_bit_for_bit(monkeypatch):
    """A sequence's rows are the same bits alone, in any batch, and (in the loop nest, which
    PAGEDSERVE_BATCH_INVARIANT keeps every chunk in) whether its prompt came in chunks."""
    monkeypatch.setattr(numba_setup, "BATCH_INVARIANT", True)
    rng = np.random.default_rng(9)
    seqs = [(70, 70), (40, 1), (100, 23), (17, 1)]
    q, k, v, qsl, lens, tables = batch = make_batch(rng, seqs, num_kv=3, group=3, head_dim=64, block_size=16)
    together = assert_each_alone_equals_together(na.paged_attention, batch)
    # Sequence 0's prompt as chunks of 30 + 1 + 24 + 15 (a one-token chunk runs as a decode does): each row
    # sees the same keys in the same order.
    a = int(qsl[0])
    parts = [na.paged_attention(q[a + s : a + e], k, v, np.array([0, e - s], np.int32), np.array([e], np.int32),
                                tables[:1], 0.125) for s, e in ((0, 30), (30, 31), (31, 55), (55, 70))]
    np.testing.assert_array_equal(np.concatenate(parts), together[a : a + 70])


def test_bad_metadata_is_refused_before_reading_the_pool():
    rng = np.random.default_rng(10)
    q, k, v, qsl, lens, tables = make_batch(rng, [(20, 4)], 1, 1, 64, 8)
    with pytest.raises(IndexError, match="block id"):
        na.paged_attention(q, k, v, qsl, lens, np.full_like(tables, k.shape[0]), 0.125)
    with pytest.raises(ValueError, match="longer than its block table"):
        na.paged_attention(q, k, v, qsl, lens + 100, tables, 0.125)
    with pytest.raises(ValueError, match="query_start_loc"):
        na.paged_attention(q, k, v, qsl + 1, lens, tables, 0.125)
    q2, k2, v2, qsl2, lens2, tables2 = make_batch(rng, [(20, 4), (9, 2)], 1, 1, 64, 8)
    falling = qsl2.copy()
    falling[1] = falling[2] + 1  # a sequence with -1 new tokens, the next with 3 more than it has
    with pytest.raises(ValueError, match="query_start_loc"):
        na.paged_attention(q2, k2, v2, falling, lens2, tables2, 0.125)
    with pytest.raises(ValueError, match="shorter than its new tokens"):
        na.paged_attention(q2, k2, v2, qsl2, np.array([3, 2], np.int32), tables2, 0.125)
    bad = tables2.copy()
    bad[1, -1] = -1  # the last entry of the table, past what the sequence uses: still refused
    with pytest.raises(IndexError, match="block id"):
        na.paged_attention(q2, k2, v2, qsl2, lens2, bad, 0.125)
    with pytest.raises(ValueError, match="integers"):
        na.paged_attention(q2, k2, v2, qsl2, lens2, tables2.astype(np.float32), 0.125)
    # shapes the compiled code was not built for (its machine code is keyed by dtypes alone), or a value
    # cache smaller than the key cache: refused, never read
    with pytest.raises(ValueError, match="value caches .* must have one shape"):
        na.paged_attention(q2, k2, v2[:-1], qsl2, lens2, tables2, 0.125)
    with pytest.raises(ValueError, match="must be .tokens, heads, head_dim."):
        na.paged_attention(q2, k2[None], v2[None], qsl2, lens2, tables2, 0.125)
    with pytest.raises(ValueError, match="disagree on the number of sequences"):
        na.paged_attention(q2, k2, v2, qsl2, lens2[:, None], tables2, 0.125)
    # what the plan holds: one work item (sequence, first token, end token) per sequence here, on one thread
    plan = na.plan_attention(q2.shape, k2.shape, qsl2, lens2, tables2)
    assert plan.items.tolist() == [[0, 0, 4], [1, 0, 2]] and plan.bounds.tolist() == [0, 2] and not plan.parallel
    assert plan.long_chunks is None and plan.query_shape == q2.shape and plan.pool == k2.shape[:2]


def _work_items_by_loop(qsl, lens, q_tile, num_chunks):
    """The work items and chunk bounds as a loop computes them, item by item (the definition)."""
    items, cost = [], []
    for i in range(len(lens)):
        n = int(qsl[i + 1] - qsl[i])
        for t0 in range(0, n, q_tile):
            t1 = min(t0 + q_tile, n)
            items.append([i, t0, t1])
            cost.append((t1 - t0) * ((int(lens[i]) - n) + (t0 + t1 + 1) / 2.0) + 16.0)
    num_chunks = max(1, min(num_chunks, len(items)))
    total = 0.0
    for c in cost:
        total += c
    bounds, c, run = [0], 1, 0.0
    for w, x in enumerate(cost):
        run += x
        while c < num_chunks and run >= total * c / num_chunks:
            bounds.append(w + 1)
            c += 1
    bounds += [len(items)] * (num_chunks + 1 - len(bounds))
    return items, bounds


def test_work_items_and_chunks_are_the_loops():
    """Items (sequence, first token, end token) and the chunk bounds (chunk c ends after the first item whose
    running cost reaches c / chunks of the total), against a loop, on random batches: decodes, long chunks,
    sequences with no new tokens, an empty batch."""
    rng = np.random.default_rng(21)
    for trial in range(300):
        num_seqs = int(rng.integers(0, 12))
        new = rng.integers(0, 70, num_seqs) * (rng.random(num_seqs) < 0.8)
        lens = new + rng.integers(0, 3000, num_seqs)
        qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int64)
        for chunks in (1, 2, 8, 64):
            items, bounds = na._work_items(qsl, lens.astype(np.int64), na.Q_TILE, chunks)
            want_items, want_bounds = _work_items_by_loop(qsl, lens, na.Q_TILE, chunks)
            assert items.dtype == bounds.dtype == np.int64 and items.flags.c_contiguous
            assert items.reshape(-1, 3).tolist() == want_items and bounds.tolist() == want_bounds, (trial, chunks)


def test_the_first_bad_sequence_names_the_error():
    """Metadata with two faults: the error is the first failing sequence's, as a scan in order finds it."""
    qsl, tables = np.array([0, 4, 3, 6], np.int64), np.zeros((3, 2), np.int32)  # sequence 1 has -1 new tokens
    assert na._scan(qsl, np.array([2, 5, 5], np.int64), tables, 6, 4, 4)[0] == 2  # sequence 0: 4 new, context 2
    assert na._scan(qsl, np.array([5, 5, 5], np.int64), tables, 6, 4, 4)[0] == 1
    assert na._scan(np.array([0, 2, 5], np.int64), np.array([3, 8], np.int64), np.zeros((2, 2), np.int32), 5, 4,
                    4) == (0, 3 * 2 + 8 * 3, 3)


@pytest.mark.parametrize("matmul_path", [False, True])
def test_a_step_plan_serves_every_layer_with_the_same_bits(monkeypatch, matmul_path):
    """The model plans once a step and passes the plan to each layer: the same bits as planning at each call,
    for decodes and prefill chunks, and with chunks on numba_prefill's matmul path (forced here)."""
    if matmul_path:
        monkeypatch.setattr(prefill, "LOOP_NEST_PAIR_COST", float("inf"))
    rng = np.random.default_rng(12)
    q, k, v, qsl, lens, tables = make_batch(rng, [(70, 40), (40, 1), (100, 23), (17, 1)], num_kv=3, group=3,
                                            head_dim=64, block_size=16)
    plan = na.plan_attention(q.shape, k.shape, qsl, lens, tables)
    assert (plan.long_chunks is not None) == matmul_path
    for layer in range(3):  # each layer its own caches and query
        k_l, v_l, q_l = k * (layer + 1), v - layer, q + layer
        np.testing.assert_array_equal(na.paged_attention(q_l, k_l, v_l, qsl, lens, tables, 0.125, plan=plan),
                                      na.paged_attention(q_l, k_l, v_l, qsl, lens, tables, 0.125))


def test_a_plan_keeps_what_it_checked_and_serves_only_its_metadata():
    rng = np.random.default_rng(13)
    q, k, v, qsl, lens, tables = make_batch(rng, [(30, 1), (50, 1)], num_kv=1, group=1, head_dim=64, block_size=8)
    expected = na.paged_attention(q, k, v, qsl, lens, tables, 0.125)
    plan = na.plan_attention(q.shape, k.shape, qsl, lens, tables)
    tables[:] = k.shape[0] + 5  # changed after planning: the plan reads its own checked copy
    lens[:] = 10_000
    np.testing.assert_array_equal(na.paged_attention(q, k, v, qsl, lens, tables, 0.125, plan=plan), expected)
    with pytest.raises(ValueError, match="made for other metadata"):
        na.paged_attention(q, k, v, qsl.copy(), lens, tables, 0.125, plan=plan)
    with pytest.raises(ValueError, match="made for other metadata"):
        na.paged_attention(q[:1], k, v, qsl, lens, tables, 0.125, plan=plan)
    with pytest.raises(ValueError, match="made for other metadata"):
        na.paged_attention(q, k[:-1], v[:-1], qsl, lens, tables, 0.125, plan=plan)  # a smaller pool
    with pytest.raises(ValueError, match="does not fit a cache"):
        na.paged_attention(q, k[:, :, :, :32].copy(), v[:, :, :, :32].copy(), qsl, lens, tables, 0.125, plan=plan)
    with pytest.raises(IndexError, match="block id"):
        na.plan_attention(q.shape, k.shape, qsl, np.array([30, 50]), tables)  # the changed tables: refused


def test_thread_count_changes_nothing(monkeypatch):
    """Small calls run the same compiled kernel on one thread: results are the same bits either way."""
    rng = np.random.default_rng(11)
    batch = make_batch(rng, [(90, 90), (33, 1), (60, 7)], num_kv=3, group=3, head_dim=64, block_size=16)
    monkeypatch.setattr(attention_plan, "PARALLEL_MIN_MACS", 0)
    parallel = na.paged_attention(*batch, 0.125)
    monkeypatch.setattr(attention_plan, "PARALLEL_MIN_MACS", 1 << 62)
    np.testing.assert_array_equal(na.paged_attention(*batch, 0.125), parallel)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_runs_of_keys_bit_for_bit_whatever_the_chunking(group, block_size, monkeypatch):
    """The loop nest takes keys in runs of RUN within a block, the keys after a row's last full run one at a
    time: a row's bits must not depend on which of its keys other rows of its tile see. A prompt ending
    mid-run, mid-block and past a segment, as one chunk, as decodes (one token per call) and as chunks cut
    at odd places (PAGEDSERVE_BATCH_INVARIANT keeps the long chunks in the loop nest)."""
    monkeypatch.setattr(numba_setup, "BATCH_INVARIANT", True)
    rng = np.random.default_rng(block_size * 10 + group)
    L = na.K_SEGMENT + 2 * block_size + na.RUN // 2 + 1
    q, k, v, qsl, lens, tables = make_batch(rng, [(L, L)], num_kv=2, group=group, head_dim=64,
                                            block_size=block_size)
    whole = check(q, k, v, qsl, lens, tables)

    scale = 64 ** -0.5
    parts = [na.paged_attention(q[s:e], k, v, np.array([0, e - s], np.int32), np.array([e], np.int32), tables, scale)
             for s, e in ((0, 5), (5, 6), (6, 29), (29, L - 3), (L - 3, L - 2), (L - 2, L))]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    decodes = [na.paged_attention(q[t:t + 1], k, v, np.array([0, 1], np.int32), np.array([t + 1], np.int32), tables,
                                  scale) for t in range(L - 40, L)]
    np.testing.assert_array_equal(np.concatenate(decodes), whole[L - 40:])
