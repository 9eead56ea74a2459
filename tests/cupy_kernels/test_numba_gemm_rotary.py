"""The qkv GEMM with the rotation and the KV cache writes in its tiles (cupy_kernels/numba_cpu/gemm_rotary.py):
the same bits as numba_gemm.matmul followed by rotary_and_cache (itself bit-equal to the numpy reference,
test_numba_ops.py), whatever the rows, tile heights, row blocks, thread count and skipped slots."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from pagedserve.cupy_kernels.host import malloc
from pagedserve.cupy_kernels.numba_cpu import cache_write, gemm, gemm_rotary, ops as numba_ops
from pagedserve.cupy_kernels.reference import ops, paged_attention as pa


def _case(rows, heads, kv_heads, head_dim, hidden=96, seed=0, num_blocks=None):
    rng = np.random.default_rng(seed)
    w = gemm.pack(rng.standard_normal(((heads + 2 * kv_heads) * head_dim, hidden), dtype=np.float32))
    x = rng.standard_normal((rows, hidden), dtype=np.float32)
    cos, sin = ops.rope_cos_sin(1.0 / (10000.0 ** (np.arange(0, head_dim, 2) / head_dim)),
                                rng.integers(0, 100_000, size=rows))
    num_blocks = num_blocks or rows // 16 + 3
    slots = rng.permutation(num_blocks * 16)[:rows].astype(np.int64)
    slots[1::4] = -1  # padding rows: nothing written
    caches = []
    for _ in range(2):
        c = malloc.aligned_empty((num_blocks, 16, kv_heads, head_dim))  # the pool's: C-contiguous, on a line
        c[...] = rng.standard_normal(c.shape, dtype=np.float32)
        caches.append(c)
    return x, w, cos, sin, caches, slots


def _copy(a):
    """A copy on a cache line (ndarray.copy is not), as the KV pool is."""
    out = malloc.aligned_empty(a.shape)
    out[...] = a
    return out


def _separate(x, w, heads, kv_heads, cos, sin, caches, slots):
    k, v = caches[0].copy(), caches[1].copy()
    q = cache_write.rotary_and_cache(gemm.matmul(x, w), heads, kv_heads, cos, sin, k, v, slots)
    return q, k, v


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 13, 37, 256])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (2, 2, 64)])
def test_the_fused_qkv_is_the_bits_of_matmul_then_rotary_and_cache(rows, heads, kv_heads, head_dim):
    """Every tile height (6, 2 and 1 rows; AVX2: 2 and 1), odd and even counts of panel pairs (rows split in two
    for an odd one), head dims of one and two pairs: query, keys and values bit for bit; slots of -1 untouched."""
    x, w, cos, sin, caches, slots = _case(rows, heads, kv_heads, head_dim, seed=rows + head_dim)
    assert gemm_rotary.fuses(x, w, heads, kv_heads, cos, sin, *caches)
    ref_q, ref_k, ref_v = _separate(x, w, heads, kv_heads, cos, sin, caches, slots)
    k, v = _copy(caches[0]), _copy(caches[1])
    q = gemm_rotary.matmul_rotary_cache(x, w, heads, kv_heads, cos, sin, k, v, slots)
    assert q.shape == (rows, heads, head_dim) and q.dtype == np.float32
    np.testing.assert_array_equal(q, ref_q)
    np.testing.assert_array_equal(k, ref_k)
    np.testing.assert_array_equal(v, ref_v)
    untouched = np.setdiff1d(np.arange(k.shape[0] * 16), slots[slots >= 0])  # the slots no row writes
    for got, before in ((k, caches[0]), (v, caches[1])):
        np.testing.assert_array_equal(got.reshape(-1, kv_heads, head_dim)[untouched],
                                      before.reshape(-1, kv_heads, head_dim)[untouched])

def test_row_blocks_and_one_thread_give_the_same_bits():
    """More rows than one L2 block (several passes over the panels), and the kernel on one thread."""
    rows, heads, kv_heads, head_dim = 1100, 3, 1, 64
    x, w, cos, sin, caches, slots = _case(rows, heads, kv_heads, head_dim, hidden=576, seed=4)
    assert gemm.row_passes(rows, 576) > 1
    ref_q, ref_k, ref_v = _separate(x, w, heads, kv_heads, cos, sin, caches, slots)
    results = []
    threads = numba.get_num_threads()
    for count in (threads, 1):
        k, v = _copy(caches[0]), _copy(caches[1])
        q = malloc.aligned_empty((rows, heads, head_dim))
        try:
            numba.set_num_threads(count)  # the compiled kernel itself: the wrapper would set the count again
            gemm_rotary._run_pairs(x, w.panels, heads, kv_heads, head_dim, cos, sin, slots, q, k, v,
                                   gemm.row_passes(rows, 576), 2,
                                   gemm_rotary._pair_order(heads, kv_heads, head_dim // (2 * gemm.PANEL)))
        finally:
            numba.set_num_threads(threads)
        results.append((q, k, v))
    for q, k, v in results:
        np.testing.assert_array_equal(q, ref_q)
        np.testing.assert_array_equal(k, ref_k)
        np.testing.assert_array_equal(v, ref_v)


def test_what_the_tiles_cannot_take_is_refused_and_the_op_composes_it():
    """A head_dim that is not two whole panels, or a cache off a cache line: `fuses` says no, the kernel raises
    ValueError naming the shapes, and ops.linear_rotary_cache computes linear, then rotary_and_cache (the
    reference's bits)."""
    x, w, cos, sin, caches, slots = _case(7, 4, 2, 48, seed=1)  # 48: not a multiple of 2 x 16 or 2 x 32
    assert not gemm_rotary.fuses(x, w, 4, 2, cos, sin, *caches)
    with pytest.raises(ValueError, match="matmul_rotary_cache"):
        gemm_rotary.matmul_rotary_cache(x, w, 4, 2, cos, sin, *caches, slots)
    k, v = caches[0].copy(), caches[1].copy()
    q = numba_ops.linear_rotary_cache(x, w, 4, 2, cos, sin, k, v, slots)
    ref_k, ref_v = caches[0].copy(), caches[1].copy()
    ref_q = pa.linear_rotary_cache(x, gemm.unpack(w).T, 4, 2, cos, sin, ref_k, ref_v, slots)
    np.testing.assert_allclose(q, ref_q, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(k, ref_k, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(v, ref_v, rtol=1e-5, atol=1e-4)

    x, w, cos, sin, (k0, v0), slots = _case(5, 2, 1, 64, seed=2)
    pool = np.zeros(k0.size + 1, dtype=np.float32)
    offset = pool[1:].reshape(k0.shape)  # 4 bytes past a line: no streamed stores
    offset[...] = k0
    assert not gemm_rotary.fuses(x, w, 2, 1, cos, sin, offset, v0)
    ref_q, ref_k, ref_v = _separate(x, w, 2, 1, cos, sin, (k0, v0), slots)
    v = v0.copy()
    np.testing.assert_array_equal(numba_ops.linear_rotary_cache(x, w, 2, 1, cos, sin, offset, v, slots), ref_q)
    np.testing.assert_array_equal(offset, ref_k)
    np.testing.assert_array_equal(v, ref_v)


def test_bad_slots_and_positions_raise_and_write_nothing():
    x, w, cos, sin, (k0, v0), slots = _case(6, 2, 1, 64, seed=3)
    k, v = _copy(k0), _copy(v0)
    bad = slots.copy()
    bad[2] = k.shape[0] * 16  # one past the pool
    assert bad[2] == 48
    with pytest.raises(IndexError, match="slot 48 is outside"):  # as rotary_and_cache (batch_checks)
        gemm_rotary.matmul_rotary_cache(x, w, 2, 1, cos, sin, k, v, bad)
    with pytest.raises(ValueError, match="cos"):
        gemm_rotary.matmul_rotary_cache(x, w, 2, 1, cos[:3], sin[:3], k, v, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        gemm_rotary.matmul_rotary_cache(x, w, 2, 1, cos, sin, k, v, slots[:4])
    np.testing.assert_array_equal(k, k0)
    np.testing.assert_array_equal(v, v0)


@pytest.mark.parametrize("heads, kv_heads, pairs_per_head", [(9, 3, 1), (32, 8, 1), (4, 4, 2), (1, 1, 1), (14, 2, 2)])
def test_the_pair_order_shares_the_slot_writes_out_over_the_threads(heads, kv_heads, pairs_per_head):
    """The prange's static halves of the pairs each hold half the key and value pairs (within one): in column
    order the last thread took every slot write."""
    order = gemm_rotary._pair_order(heads, kv_heads, pairs_per_head)
    n, queries = order.size, heads * pairs_per_head
    assert sorted(order.tolist()) == list(range(n))
    assert [p for p in order if p < queries] == list(range(queries))  # the query pairs keep their order
    first_half = int((order[: n // 2] >= queries).sum())
    assert abs(2 * first_half - 2 * kv_heads * pairs_per_head) <= 2
