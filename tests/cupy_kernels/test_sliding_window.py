"""Sliding-window paged attention (`sliding_window=W`: a query at p sees keys p - W < k <= p, Hugging Face
Gemma 3's sliding_window_overlay) in the numpy reference and the numba set: the reference against a dense
float64 oracle that never touches blocks, the numba set (loop nest and prefill matmul path) against the
reference, keys older than the window never read, batch and chunking invariance. The CUDA kernel's
checks run on the host emulation (test_kernels_on_host.py).

Tolerance as in test_numba_attention.py: 8 * (D + L) * eps * max|v|.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from paged_batches import assert_each_alone_equals_together, make_batch

from pagedserve.cupy_kernels.numba_cpu import attention as na
from pagedserve.cupy_kernels.numba_cpu import prefill as npf
from pagedserve.cupy_kernels.numba_cpu import setup as numba_setup
from pagedserve.cupy_kernels.reference import paged_attention as pa

EPS = np.finfo(np.float32).eps
# (context_len, new tokens): decodes, whole prompts, chunks deep in a context, short ones
SEQS = [(150, 1), (150, 150), (150, 37), (33, 1), (20, 20), (7, 1), (64, 16), (97, 2)]


def dense_attention(q, k, v, qsl, lens, tables, scale, window):
    """The oracle: each sequence's keys gathered whole, float64, the mask written from the definition."""
    block_size = k.shape[1]
    group = q.shape[1] // k.shape[2]
    out = np.zeros(q.shape, np.float64)
    for i in range(len(lens)):
        L, a, b = int(lens[i]), int(qsl[i]), int(qsl[i + 1])
        pos = np.arange(L)
        slots = tables[i, pos // block_size].astype(np.int64) * block_size + pos % block_size
        keys = k.reshape(-1, *k.shape[2:])[slots].astype(np.float64)  # [L, KV, D]
        values = v.reshape(-1, *v.shape[2:])[slots].astype(np.float64)
        for j in range(b - a):
            p = L - (b - a) + j
            seen = (pos <= p) & ((pos > p - window) if window else True)
            for h in range(q.shape[1]):
                s = keys[seen, h // group] @ q[a + j, h].astype(np.float64) * scale
                w = np.exp(s - s.max())
                out[a + j, h] = (w / w.sum()) @ values[seen, h // group]
    return out


def tolerance(q, v, lens):
    return 8 * (q.shape[2] + int(lens.max())) * EPS * float(np.abs(v).max())


def poison_old_blocks(k, v, qsl, lens, tables, window):
    """Copies of the caches with NaN in every block wholly older than the window of its sequence's first
    query row: blocks the KV manager may have given away, which no kernel may read."""
    k, v = k.copy(), v.copy()
    block_size = k.shape[1]
    count = 0
    for i in range(len(lens)):
        oldest = max(0, int(lens[i]) - int(qsl[i + 1] - qsl[i]) - window + 1)
        for b in range(oldest // block_size):
            k[tables[i, b]] = v[tables[i, b]] = np.nan
            count += 1
    assert count, "the batch has no block older than its window: the check would be empty"
    return k, v


@pytest.fixture
def loop_nest_only(monkeypatch):
    monkeypatch.setattr(numba_setup, "BATCH_INVARIANT", True)


@pytest.fixture
def prefill_path(monkeypatch):
    monkeypatch.setattr(npf, "LOOP_NEST_PAIR_COST", 100.0)  # every chunk of 16+ tokens takes the matmul path


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 149, 150, 500])
@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_matches_the_dense_oracle(window, block_size):
    rng = np.random.default_rng(window * 10 + block_size)
    q, k, v, qsl, lens, tables = make_batch(rng, SEQS, num_kv=2, group=3, head_dim=32, block_size=block_size)
    got = pa.paged_attention(q, k, v, qsl, lens, tables, 0.2, sliding_window=window)
    np.testing.assert_allclose(got, dense_attention(q, k, v, qsl, lens, tables, 0.2, window), rtol=0,
                               atol=tolerance(q, v, lens))


@pytest.mark.parametrize("window", [37, 512])
def test_reference_matches_the_dense_oracle_at_head_dim_256(window):
    """Gemma 3 270M's shape (4 query heads on 1 kv head, head dim 256; window 512): contexts past the window, a
    chunk deep in one. The reference the CUDA kernel's head-dim-256 checks compare with (test_kernels_on_host.py)."""
    rng = np.random.default_rng(window)
    q, k, v, qsl, lens, tables = make_batch(rng, [(1100, 1), (600, 1), (300, 45), (20, 20)], num_kv=1, group=4,
                                            head_dim=256, block_size=16)
    got = pa.paged_attention(q, k, v, qsl, lens, tables, 1 / 16, sliding_window=window)
    np.testing.assert_allclose(got, dense_attention(q, k, v, qsl, lens, tables, 1 / 16, window), rtol=0,
                               atol=tolerance(q, v, lens))


def test_the_window_changes_the_result_and_a_window_past_the_context_does_not():
    """A window as long as the longest context is no window (the same bits); a shorter one is not."""
    rng = np.random.default_rng(1)
    batch = make_batch(rng, SEQS, num_kv=2, group=2, head_dim=32, block_size=16)
    for attention in (pa.paged_attention, na.paged_attention):
        full = attention(*batch, 0.2)
        np.testing.assert_array_equal(attention(*batch, 0.2, sliding_window=150), full)
        windowed = attention(*batch, 0.2, sliding_window=40)
        assert np.abs(windowed - full).max() > 0.05


@pytest.mark.parametrize("path", ["loop_nest_only", "prefill_path"])
@pytest.mark.parametrize("window", [1, 7, 16, 33, 100])
@pytest.mark.parametrize("block_size,group", [(16, 1), (16, 3), (8, 4)])
def test_numba_matches_the_reference(path, window, block_size, group, request):
    request.getfixturevalue(path)
    rng = np.random.default_rng(window + block_size + group)
    batch = make_batch(rng, SEQS, num_kv=2, group=group, head_dim=64, block_size=block_size)
    got = na.paged_attention(*batch, 0.125, sliding_window=window)
    ref = pa.paged_attention(*batch, 0.125, sliding_window=window)
    np.testing.assert_allclose(got, ref, rtol=0, atol=tolerance(batch[0], batch[2], batch[4]))


def test_numba_long_contexts_cross_the_loop_nests_segments(loop_nest_only):
    """Contexts past K_SEGMENT (512) keys: the window's walk starts inside a later segment, or spans two."""
    rng = np.random.default_rng(3)
    seqs = [(1300, 1), (700, 1), (1100, 20), (600, 600)]
    batch = make_batch(rng, seqs, num_kv=1, group=2, head_dim=64, block_size=16)
    for window in (100, 512, 530, 1000):
        got = na.paged_attention(*batch, 0.125, sliding_window=window)
        ref = pa.paged_attention(*batch, 0.125, sliding_window=window)
        np.testing.assert_allclose(got, ref, rtol=0, atol=tolerance(batch[0], batch[2], batch[4]))


@pytest.mark.parametrize("path", ["reference", "loop_nest_only", "prefill_path"])
@pytest.mark.parametrize("window", [3, 16, 21])
def test_keys_older_than_the_window_are_never_read(path, window, request):
    """NaN in every block wholly older than a sequence's window: the same bits as clean caches."""
    attention = pa.paged_attention if path == "reference" else na.paged_attention
    if path != "reference":
        request.getfixturevalue(path)
    rng = np.random.default_rng(window)
    q, k, v, qsl, lens, tables = make_batch(rng, SEQS, num_kv=2, group=2, head_dim=64, block_size=4)
    clean = attention(q, k, v, qsl, lens, tables, 0.125, sliding_window=window)
    bad_k, bad_v = poison_old_blocks(k, v, qsl, lens, tables, window)
    got = attention(q, bad_k, bad_v, qsl, lens, tables, 0.125, sliding_window=window)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, clean)


@pytest.mark.parametrize("path", ["loop_nest_only", "prefill_path"])
@pytest.mark.parametrize("window", [5, 16, 40])
def test_numba_batch_invariance_with_a_window(path, window, request):
    request.getfixturevalue(path)
    rng = np.random.default_rng(window + 7)
    batch = make_batch(rng, SEQS, num_kv=2, group=3, head_dim=64, block_size=16)
    assert_each_alone_equals_together(functools.partial(na.paged_attention, sliding_window=window), batch)


@pytest.mark.parametrize("window", [1, 9, 16, 45])
def test_loop_nest_rows_are_the_same_bits_however_the_prompt_is_chunked(window, loop_nest_only):
    """One prompt of 90 tokens in one call, in chunks of 7, 30 and 53, and token by token: the same bits (the
    walk starts at the tile of each chunk's first row; a row's arithmetic must not depend on it)."""
    rng = np.random.default_rng(window)
    q, k, v, _, lens, tables = make_batch(rng, [(90, 90)], num_kv=2, group=2, head_dim=64, block_size=16)
    whole = na.paged_attention(q, k, v, np.array([0, 90]), lens, tables, 0.125, sliding_window=window)
    for cuts in ([0, 7, 37, 90], list(range(91))):
        for a, b in zip(cuts[:-1], cuts[1:]):
            part = na.paged_attention(q[a:b], k, v, np.array([0, b - a]), np.array([b]), tables, 0.125,
                                      sliding_window=window)
            np.testing.assert_array_equal(part, whole[a:b], err_msg=f"rows {a}:{b}")


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "16"])
def test_a_bad_window_is_refused_naming_the_field(bad):
    q, k, v, qsl, lens, tables = make_batch(np.random.default_rng(0), [(5, 1)], 1, 1, 16, 4)
    for attention in (pa.paged_attention, na.paged_attention):
        with pytest.raises(ValueError, match="sliding_window"):
            attention(q, k, v, qsl, lens, tables, 0.25, sliding_window=bad)
