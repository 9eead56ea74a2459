"""numba elementwise kernels and the KV cache write (cupy_kernels/numba_cpu/ops.py) against the numpy references.

Tolerances from float32 rounding: RMSNorm sums `hidden` squares (relative error up to about hidden * eps in
the sum, half that after the square root) and then divides and multiplies (2 eps). SiLU is a few operations
per element with a polynomial exp within 2 ulp: a few eps. Bit for bit: the residual add (one rounding, as
numpy's), rotary (the same two products and one add, each rounded), cache writes (copies).
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.cupy_kernels.numba_cpu import ops as nb
from pagedserve.cupy_kernels.reference import ops
from pagedserve.cupy_kernels.reference import paged_attention as pa
from numerics import f32_tol

EPS = np.finfo(np.float32).eps
ROWS = [0, 1, 5, nb.PARALLEL_MIN_ROWS + 3]  # empty, one row (C-contiguous views), serial, parallel


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [8, 576, 1000])
def test_add_rms_norm(rows, hidden):
    rng = np.random.default_rng(rows + hidden)
    x = (rng.standard_normal((rows, hidden)) * 3).astype(np.float32)
    res = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    ref_n, ref_r = ops.add_rms_norm(x, res.copy(), w, 1e-6)
    res_nb = res.copy()
    got_n, got_r = nb.add_rms_norm(x, res_nb, w, 1e-6)
    assert got_r is res_nb  # updated in place, like the reference
    np.testing.assert_array_equal(got_r, ref_r)
    tol = (hidden / 2 + 4) * EPS
    np.testing.assert_allclose(got_n, ref_n, rtol=tol, atol=tol * float(np.abs(ref_n).max(initial=0)))
    got0, res0 = nb.add_rms_norm(x, None, w, 1e-6)  # first layer: x becomes the residual
    assert res0 is x
    np.testing.assert_allclose(got0, ops.rms_norm(x, w, 1e-6), rtol=tol, atol=tol * float(np.abs(got0).max(initial=0)))


@pytest.mark.parametrize("rows", ROWS)
def test_apply_rotary_on_qkv_views(rows):
    rng = np.random.default_rng(rows)
    heads, d = 3, 64
    qkv = rng.standard_normal((rows, 5 * heads * d)).astype(np.float32)
    x = qkv[:, : heads * d].reshape(rows, heads, d)  # strided view (C-contiguous when rows == 1)
    positions = rng.integers(0, 100_000, size=rows)
    cos, sin = ops.rope_cos_sin(1.0 / (10000.0 ** (np.arange(0, d, 2) / d)), positions)
    ref = ops.apply_rotary(x, cos, sin)
    got = nb.apply_rotary(x, cos, sin)
    np.testing.assert_array_equal(got, ref)  # the same two products and one add, each rounded: bit for bit


HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def _rotary_and_cache_case(rows, block_size=16, dtype=np.float32):
    """A layer's qkv projection, positions, and caches with some slots skipped (-1), as the model passes them."""
    rng = np.random.default_rng(rows + block_size)
    num_blocks = 40
    qkv = rng.standard_normal((rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(dtype)
    cos, sin = ops.rope_cos_sin(1.0 / (10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)),
                                rng.integers(0, 100_000, size=rows))
    slots = rng.permutation(num_blocks * block_size)[:rows].astype(np.int64)
    slots[1::3] = -1
    caches = [rng.standard_normal((num_blocks, block_size, KV_HEADS, HEAD_DIM)).astype(dtype) for _ in range(2)]
    return qkv, cos, sin, caches, slots


@pytest.mark.parametrize("rows", ROWS)
def test_rotary_and_cache_matches_the_two_ops(rows):
    """One pass over qkv = apply_rotary on its query and key heads + reshape_and_cache of the rotated key and
    the value, bit for bit (numpy's rotary rounds the same two products and one add), skipped slots untouched."""
    qkv, cos, sin, (k0, v0), slots = _rotary_and_cache_case(rows)
    q, k, v = pa.split_qkv(qkv, HEADS, KV_HEADS, HEAD_DIM)
    ref_k, ref_v, got_k, got_v = k0.copy(), v0.copy(), k0.copy(), v0.copy()
    ref_q = pa.rotary_and_cache(qkv, HEADS, KV_HEADS, cos, sin, ref_k, ref_v, slots)
    np.testing.assert_array_equal(ref_q, ops.apply_rotary(q, cos, sin))
    written = slots >= 0
    np.testing.assert_array_equal(ref_k.reshape(-1, KV_HEADS, HEAD_DIM)[slots[written]],
                                  ops.apply_rotary(k, cos, sin)[written])
    np.testing.assert_array_equal(ref_v.reshape(-1, KV_HEADS, HEAD_DIM)[slots[written]], v[written])
    got_q = nb.rotary_and_cache(qkv, HEADS, KV_HEADS, cos, sin, got_k, got_v, slots)
    np.testing.assert_array_equal(got_q, ref_q)
    np.testing.assert_array_equal(got_k, ref_k)
    np.testing.assert_array_equal(got_v, ref_v)
    kept = np.ones(k0.shape[0] * k0.shape[1], dtype=bool)
    kept[slots[written]] = False
    np.testing.assert_array_equal(got_k.reshape(-1, KV_HEADS, HEAD_DIM)[kept], k0.reshape(-1, KV_HEADS, HEAD_DIM)[kept])
    if rows:  # a strided qkv (a column slice of a wider array) gives the same
        wide = np.concatenate([qkv, np.zeros((rows, 7), np.float32)], axis=1)[:, : qkv.shape[1]]
        again_k, again_v = k0.copy(), v0.copy()
        np.testing.assert_array_equal(nb.rotary_and_cache(wide, HEADS, KV_HEADS, cos, sin, again_k, again_v, slots),
                                      ref_q)
        np.testing.assert_array_equal(again_k, ref_k)


def test_rotary_and_cache_on_threads_writes_what_one_thread_does(monkeypatch):
    """From PARALLEL_MIN_TOKENS tokens the step is shared out over the threads (token ranges): the same bits as
    the reference, and as the same call on one thread."""
    from pagedserve.cupy_kernels.numba_cpu import cache_write

    rows = cache_write.PARALLEL_MIN_TOKENS + 5
    qkv, cos, sin, (k0, v0), slots = _rotary_and_cache_case(rows, block_size=64)
    ref_k, ref_v = k0.copy(), v0.copy()
    ref_q = pa.rotary_and_cache(qkv, HEADS, KV_HEADS, cos, sin, ref_k, ref_v, slots)
    results = []
    for threshold in (cache_write.PARALLEL_MIN_TOKENS, rows + 1):  # shared out; one thread
        monkeypatch.setattr(cache_write, "PARALLEL_MIN_TOKENS", threshold)
        k, v = k0.copy(), v0.copy()
        results.append((nb.rotary_and_cache(qkv, HEADS, KV_HEADS, cos, sin, k, v, slots), k, v))
    for q, k, v in results:
        np.testing.assert_array_equal(q, ref_q)
        np.testing.assert_array_equal(k, ref_k)
        np.testing.assert_array_equal(v, ref_v)


@pytest.mark.parametrize("head_dim", [8, 40, 96])
def test_rotary_and_cache_vector_and_scalar_pairs(head_dim):
    """Head dims whose half is below, between and at multiples of the rotation's 16 lanes: the same bits as the
    reference; caches that are not C-contiguous (every other block of a larger pool) are written in place."""
    rng = np.random.default_rng(head_dim)
    rows, kv, heads = 11, 2, 4
    qkv = rng.standard_normal((rows, (heads + 2 * kv) * head_dim)).astype(np.float32)
    cos, sin = ops.rope_cos_sin(1.0 / (10000.0 ** (np.arange(0, head_dim, 2) / head_dim)), rng.integers(0, 9999, rows))
    slots = rng.permutation(6 * 16)[:rows].astype(np.int64)
    k0, v0 = (rng.standard_normal((6, 16, kv, head_dim)).astype(np.float32) for _ in range(2))
    ref_k, ref_v, got_k, got_v = k0.copy(), v0.copy(), k0.copy(), v0.copy()
    ref_q = pa.rotary_and_cache(qkv, heads, kv, cos, sin, ref_k, ref_v, slots)
    np.testing.assert_array_equal(nb.rotary_and_cache(qkv, heads, kv, cos, sin, got_k, got_v, slots), ref_q)
    np.testing.assert_array_equal(got_k, ref_k)
    np.testing.assert_array_equal(got_v, ref_v)
    wide_k, wide_v = np.zeros((12, 16, kv, head_dim), np.float32), np.zeros((12, 16, kv, head_dim), np.float32)
    wide_k[::2], wide_v[::2] = k0, v0
    np.testing.assert_array_equal(nb.rotary_and_cache(qkv, heads, kv, cos, sin, wide_k[::2], wide_v[::2], slots), ref_q)
    np.testing.assert_array_equal(wide_k[::2], ref_k)
    np.testing.assert_array_equal(wide_v[::2], ref_v)


@pytest.mark.parametrize("aligned", [True, False])
def test_rotary_and_cache_streams_rows_into_a_page_aligned_pool(aligned):
    """A pool on a 64-byte boundary (models.kv_cache.host_zeros maps its own pages) takes the non-temporal row
    copies, one 16 bytes off a boundary the element loop: both write what the reference writes, nothing else."""
    from pagedserve.models.kv_cache import host_zeros

    qkv, cos, sin, (k0, v0), slots = _rotary_and_cache_case(37)
    ref_k, ref_v = k0.copy(), v0.copy()
    ref_q = pa.rotary_and_cache(qkv, HEADS, KV_HEADS, cos, sin, ref_k, ref_v, slots)
    caches = []
    for src in (k0, v0):
        flat = host_zeros((src.size + 4,), np.float32)
        cache = (flat[: src.size] if aligned else flat[4:]).reshape(src.shape)
        cache[...] = src
        assert (cache.ctypes.data % 64 == 0) == aligned
        caches.append(cache)
    np.testing.assert_array_equal(nb.rotary_and_cache(qkv, HEADS, KV_HEADS, cos, sin, *caches, slots), ref_q)
    np.testing.assert_array_equal(caches[0], ref_k)
    np.testing.assert_array_equal(caches[1], ref_v)


def test_rotary_and_cache_refuses_what_its_loop_would_overrun():
    qkv, cos, sin, (k0, v0), slots = _rotary_and_cache_case(7)
    before = k0.copy()
    with pytest.raises(IndexError, match="outside a cache"):
        nb.rotary_and_cache(qkv, HEADS, KV_HEADS, cos, sin, k0, v0, np.full(7, k0.shape[0] * k0.shape[1]))
    with pytest.raises(IndexError, match="outside a cache"):  # one token (its slot read without a reduction)
        nb.rotary_and_cache(qkv[:1], HEADS, KV_HEADS, cos, sin, k0, v0, np.array([k0.shape[0] * k0.shape[1]]))
    with pytest.raises(ValueError, match="slot_mapping"):
        nb.rotary_and_cache(qkv, HEADS, KV_HEADS, cos, sin, k0, v0, slots[:6])
    with pytest.raises(ValueError, match="do not fit"):
        nb.rotary_and_cache(qkv, HEADS, KV_HEADS, cos, sin, k0[:, :, :2], v0[:, :, :2], slots)  # 2 kv heads cached
    with pytest.raises(ValueError, match="do not fit"):
        nb.rotary_and_cache(qkv, HEADS + 1, KV_HEADS, cos, sin, k0, v0, slots)  # qkv too narrow for 10 heads
    with pytest.raises(ValueError, match="do not fit"):
        nb.rotary_and_cache(qkv, HEADS, KV_HEADS, cos[:6], sin[:6], k0, v0, slots)  # positions for 6 of 7 tokens
    with pytest.raises(ValueError, match="do not fit"):
        nb.rotary_and_cache(qkv, HEADS, KV_HEADS, cos, sin, k0, v0[:-1], slots)
    np.testing.assert_array_equal(k0, before)  # nothing was written


def test_rotary_and_cache_with_float64_positions_after_float32_ones_takes_the_reference():
    """The compiled kernel is looked up by its arrays' dtypes: float64 cos/sin after a float32 call never reuse the
    float32 machine code (they take the reference, whose float64 products round otherwise)."""
    qkv, cos, sin, (k0, v0), slots = _rotary_and_cache_case(9)
    nb.rotary_and_cache(qkv, HEADS, KV_HEADS, cos, sin, k0.copy(), v0.copy(), slots)
    cos64, sin64 = cos.astype(np.float64), sin.astype(np.float64)
    ref_k, ref_v, got_k, got_v = k0.copy(), v0.copy(), k0.copy(), v0.copy()
    ref_q = pa.rotary_and_cache(qkv, HEADS, KV_HEADS, cos64, sin64, ref_k, ref_v, slots)
    np.testing.assert_array_equal(nb.rotary_and_cache(qkv, HEADS, KV_HEADS, cos64, sin64, got_k, got_v, slots), ref_q)
    np.testing.assert_array_equal(got_k, ref_k)
    np.testing.assert_array_equal(got_v, ref_v)


def test_rotary_and_cache_other_dtypes_take_the_reference():
    qkv, cos, sin, (k0, v0), slots = _rotary_and_cache_case(5, dtype=np.float16)
    ref_k, ref_v = k0.copy(), v0.copy()
    ref_q = pa.rotary_and_cache(qkv, HEADS, KV_HEADS, cos, sin, ref_k, ref_v, slots)
    got_q = nb.rotary_and_cache(qkv, HEADS, KV_HEADS, cos, sin, k0, v0, slots)
    assert got_q.dtype == np.float16
    np.testing.assert_array_equal(got_q, ref_q)
    np.testing.assert_array_equal(k0, ref_k)
    np.testing.assert_array_equal(v0, ref_v)
    with pytest.raises(ValueError, match="is not 10 query and 3 kv heads"):
        pa.rotary_and_cache(qkv, HEADS + 1, KV_HEADS, cos, sin, k0, v0, slots)


@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul(rows):
    rng = np.random.default_rng(rows + 1)
    x = (rng.standard_normal((rows, 2 * 700)) * 6).astype(np.float32)
    if rows:
        x[0, :7] = [-100, -88, -30, 0, 30, 88, 100]  # exp's clamps and overflow: silu -> -0 / identity
    ref = ops.silu_and_mul(x)
    got = nb.silu_and_mul(x)
    np.testing.assert_allclose(got, ref, rtol=8 * EPS, atol=1e-30)
    # the 16-lane vectors and the last 700 % 16 one at a time: the bits of the scalar formula compiled by numba
    np.testing.assert_array_equal(_scalar_silu_and_mul(x), got)
    if rows:  # a strided input (a column slice of a wider array) gives the same
        wide = np.concatenate([x, np.ones((rows, 5), np.float32)], axis=1)[:, : x.shape[1]]
        np.testing.assert_array_equal(nb.silu_and_mul(wide), got)


def _scalar_silu_and_mul(x):
    from pagedserve.cupy_kernels.numba_cpu.setup import JIT_EXACT, numba

    @numba.njit(**{**JIT_EXACT, "cache": False})
    def run(x, out):
        inter = out.shape[1]
        for t in range(x.shape[0]):
            for i in range(inter):
                g = x[t, i]
                out[t, i] = g / (np.float32(1.0) + nb.fast_exp(-g)) * x[t, inter + i]

    out = np.empty((x.shape[0], x.shape[1] // 2), np.float32)
    run(x, out)
    return out


def test_silu_and_mul_is_the_same_bits_on_one_thread_or_all(monkeypatch):
    """From SILU_PARALLEL_MIN_ROWS rows SiLU shares its rows over the threads: the same compiled code per row,
    so the same bits as on one thread."""
    x = (np.random.default_rng(9).standard_normal((40, 2 * 700)) * 6).astype(np.float32)
    assert x.shape[0] >= nb.SILU_PARALLEL_MIN_ROWS
    shared = nb.silu_and_mul(x)
    monkeypatch.setattr(nb, "SILU_PARALLEL_MIN_ROWS", 10**9)
    np.testing.assert_array_equal(nb.silu_and_mul(x), shared)


def test_add_rms_norm_is_the_same_bits_on_one_thread_or_all(monkeypatch):
    """From NORM_PARALLEL_MIN_ROWS rows the norms share their rows over the threads: the same bits."""
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((40, 576)) * 3).astype(np.float32)
    res = rng.standard_normal((40, 576)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(576)).astype(np.float32)
    assert x.shape[0] >= nb.NORM_PARALLEL_MIN_ROWS
    shared_n, shared_r = nb.add_rms_norm(x, res.copy(), w, 1e-6)
    shared_plain = nb.rms_norm(x, w, 1e-6)
    monkeypatch.setattr(nb, "NORM_PARALLEL_MIN_ROWS", 10**9)
    one_n, one_r = nb.add_rms_norm(x, res.copy(), w, 1e-6)
    np.testing.assert_array_equal(one_n, shared_n)
    np.testing.assert_array_equal(one_r, shared_r)
    np.testing.assert_array_equal(nb.rms_norm(x, w, 1e-6), shared_plain)


@pytest.mark.parametrize("rows,vocab", [(0, 9), (1, 1), (1, 49152), (3, 1000), (5, 4 * nb.LOGSUMEXP_PARALLEL_MIN // 5 + 7)])  # noqa: E501
@pytest.mark.parametrize("given_max", [False, True])
def test_logsumexp_rows(rows, vocab, given_max):
    """The sampler's log-normaliser: a sum of `vocab` exps (each within 2 ulp), then a log and an add. Masked
    (-inf) and very negative logits contribute about nothing, as they do to the float64 truth."""
    rng = np.random.default_rng(rows * 7 + vocab)
    x = (rng.standard_normal((rows, vocab)) * 8).astype(np.float32)
    if rows and vocab > 4:
        x[0, :3] = [-np.inf, -1e30, 30.0]
    ref = ops.logsumexp_rows(x.astype(np.float64)) if rows else np.zeros(0)
    got = nb.logsumexp_rows(x, x.max(axis=1) if given_max else None)
    assert got.shape == (rows,) and got.dtype == np.float32
    scale = float(np.abs(ref).max(initial=1.0))
    np.testing.assert_allclose(got, ref, rtol=0, atol=f32_tol(scale, vocab) + 4 * EPS * scale)
    # the numpy reference the numpy set uses, in float32, agrees to the same bound
    np.testing.assert_allclose(ops.logsumexp_rows(x), ref, rtol=0, atol=f32_tol(scale, vocab) + 4 * EPS * scale)
    with pytest.raises(ValueError, match="row_max of shape"):
        nb.logsumexp_rows(np.ones((2, 3), np.float32), np.ones(3, np.float32))


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 33, 100, 4 * nb.LOGSUMEXP_PARALLEL_MIN // 5 + 7])
def test_argmax_rows_is_numpys(vocab):
    """The greedy rows' argmax: numpy's rule, the first largest value, or the first NaN where there is one;
    rows of ties, of -inf alone, with +inf, on both sides of the 16 lanes (and of the parallel threshold)."""
    rng = np.random.default_rng(vocab)
    for trial in range(12):
        x = rng.integers(-3, 3, size=(6, vocab)).astype(np.float32)  # many ties
        if trial % 4 == 1:
            x[rng.random(x.shape) < 0.1] = np.nan
        elif trial % 4 == 2:
            x[rng.random(x.shape) < 0.2] = np.inf
        elif trial % 4 == 3:
            x[rng.random(x.shape) < 0.7] = -np.inf
            x[0] = -np.inf
        got = nb.argmax_rows(x)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, np.argmax(x, axis=1))
    np.testing.assert_array_equal(nb.argmax_rows(np.zeros((0, 4), np.float32)), np.zeros(0, np.int64))


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 1000), (7, 49152), (2, 4 * nb.LOGSUMEXP_PARALLEL_MIN // 2 + 3)])
def test_argmax_rows_gives_logsumexp_rows_bits(rows, vocab):
    """argmax_rows(x, lse_out=...): the row's log-sum-exp as logsumexp_rows(x, its max) computes it, bit for bit."""
    x = (np.random.default_rng(vocab).standard_normal((rows, vocab)) * 8).astype(np.float32)
    lse = np.full(rows, np.nan, np.float32)
    tokens = nb.argmax_rows(x, lse_out=lse)
    np.testing.assert_array_equal(tokens, np.argmax(x, axis=1))
    np.testing.assert_array_equal(lse.view(np.uint32), nb.logsumexp_rows(x, x[np.arange(rows), tokens]).view(np.uint32))
    with pytest.raises(ValueError, match="lse_out must be float32"):
        nb.argmax_rows(x, lse_out=np.empty(rows + 1, np.float32))


def test_fast_exp_within_two_ulp():
    from pagedserve.cupy_kernels.numba_cpu.setup import numba

    @numba.njit
    def exp_all(xs, out):
        for i in range(xs.size):
            out[i] = nb.fast_exp(xs[i])

    xs = np.linspace(-87, 88, 200_001).astype(np.float32)
    got = np.empty_like(xs)
    exp_all(xs[::1000].copy(), got)
    exact = np.exp(xs[::1000].astype(np.float64))
    assert (np.abs(got[: exact.size] - exact) <= 2 * np.spacing(exact.astype(np.float32))).all()



def test_fast_exp2_within_two_ulp_on_the_softmax_range():
    """2^x for x <= 0 (scores minus their row max, in log2 units), down to the clamp at -126."""
    from pagedserve.cupy_kernels.numba_cpu.setup import numba

    @numba.njit
    def exp2_all(xs, out):
        for i in range(xs.size):
            out[i] = nb.fast_exp2(xs[i])

    xs = np.concatenate([np.linspace(-126, 0, 200_001), np.linspace(-1, 0, 10_001)]).astype(np.float32)
    got = np.empty_like(xs)
    exp2_all(xs, got)
    exact = np.exp2(xs.astype(np.float64))
    assert (np.abs(got - exact) <= 2 * np.spacing(exact.astype(np.float32))).all()
    exp2_all(np.array([-130.0, -1000.0], np.float32), got[:2])  # clamped: tiny, positive, never 0 or NaN
    assert (got[:2] > 0).all() and (got[:2] < 1.2e-38).all()

@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("rows", [0, 1, 37])
def test_reshape_and_cache(block_size, rows):
    rng = np.random.default_rng(block_size + rows)
    num_blocks, kv, d = 6, 3, 64
    qkv = rng.standard_normal((rows, (3 + 2 * kv) * d)).astype(np.float32)
    key = qkv[:, 3 * d : (3 + kv) * d].reshape(rows, kv, d)
    value = qkv[:, (3 + kv) * d :].reshape(rows, kv, d)
    slots = rng.permutation(num_blocks * block_size)[:rows].astype(np.int64)
    slots[::4] = -1  # skipped
    k0 = rng.standard_normal((num_blocks, block_size, kv, d)).astype(np.float32)
    v0 = rng.standard_normal((num_blocks, block_size, kv, d)).astype(np.float32)
    ref_k, ref_v, got_k, got_v = k0.copy(), v0.copy(), k0.copy(), v0.copy()
    pa.reshape_and_cache(key, value, ref_k, ref_v, slots)
    nb.reshape_and_cache(key, value, got_k, got_v, slots)
    np.testing.assert_array_equal(got_k, ref_k)
    np.testing.assert_array_equal(got_v, ref_v)
    if rows:
        with pytest.raises(IndexError, match="outside a cache"):
            nb.reshape_and_cache(key, value, got_k, got_v, np.full(rows, num_blocks * block_size))




@pytest.mark.parametrize("name", ["exp_sum", "exp2_sum"])
def test_exp_sum_has_fast_exps_bits_and_a_sum_fixed_by_the_row_alone(name):
    """numerics.exp_sum and exp2_sum (the softmaxes' vector exponentials: attention.py, prefill.py): each
    value equals the scalar fast_exp's (fast_exp2's) bits, at every length around its 16 lanes and at rows
    starting off a vector boundary; the sum is within float32 rounding of numpy's and the same bits wherever
    the row lies in its buffer."""
    from pagedserve.cupy_kernels.numba_cpu import numerics
    from pagedserve.cupy_kernels.numba_cpu.setup import numba

    vector, scalar = (numerics.exp_sum, numerics.fast_exp) if name == "exp_sum" else (numerics.exp2_sum,
                                                                                      numerics.fast_exp2)

    @numba.njit
    def exps(s, offset, n, shift, out):
        for r in range(s.shape[0]):
            out[r] = vector(s[r, offset:offset + n], n, shift)

    @numba.njit
    def scalar_exps(x, shift, out):
        for i in range(x.shape[0]):
            out[i] = scalar(x[i] - shift)

    rng = np.random.default_rng(5)
    shift = np.float32(3.25)
    base = (shift - np.abs(rng.standard_normal((8, 300))) * 30).astype(np.float32)  # scores <= their max
    base[0, :40] = [-np.inf, -200.0, -87.5, 0.0, shift] * 8  # clamped below, and exp(-inf) = tiny
    if name == "exp_sum":
        base[0, 3] = 95.0  # clamped above, once (a sum of several would overflow float32)
    want = np.empty_like(base)
    scalar_exps(base.reshape(-1), shift, want.reshape(-1))
    sums = {}
    for offset in (0, 1, 5, 16):
        for n in (1, 2, 15, 16, 17, 31, 32, 33, 200, 300 - offset):
            s = base.copy()
            out = np.empty(8, dtype=np.float32)
            exps(s, offset, n, shift, out)
            np.testing.assert_array_equal(s[:, offset:offset + n], want[:, offset:offset + n],
                                          err_msg=f"{offset=} {n=}")
            np.testing.assert_array_equal(s[:, :offset], base[:, :offset])  # nothing outside the row is touched
            np.testing.assert_array_equal(s[:, offset + n:], base[:, offset + n:])
            exact = want[:, offset:offset + n].astype(np.float64).sum(axis=1)
            np.testing.assert_allclose(out, exact, rtol=n * 2e-7, err_msg=f"{offset=} {n=}")
            # The same values at another place in the buffer: the same sum, bit for bit.
            moved = np.zeros((8, 320), dtype=np.float32)
            moved[:, 3:3 + n] = base[:, offset:offset + n]
            again = np.empty(8, dtype=np.float32)
            exps(moved, 3, n, shift, again)
            np.testing.assert_array_equal(again, out, err_msg=f"{offset=} {n=}")
            sums[offset, n] = out
    assert len(sums) == 40


@pytest.mark.parametrize("rows", [1, 13, 130])
def test_linear_silu_and_mul_on_a_gated_weight(rows):
    """The numba set's gated gate_up (pack_weight(..., gated=True)): SiLU-and-mul in the GEMM, the bits of
    silu_and_mul after linear on the plain panels; near the reference's composition on the [in, out] array."""
    rng = np.random.default_rng(rows)
    gate, up = (rng.standard_normal((2, 200, 64)) * 0.3).astype(np.float32)
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    gated, plain = nb.pack_weight([gate, up], gated=True), nb.pack_weight([gate, up])
    got = nb.linear_silu_and_mul(x, gated)
    np.testing.assert_array_equal(got, nb.silu_and_mul(nb.linear(x, plain)))
    np.testing.assert_array_equal(nb.linear_silu_and_mul(x, plain), got)  # plain panels: the composition
    ref = ops.linear_silu_and_mul(x, np.concatenate([gate, up]).T)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
    with pytest.raises(ValueError, match="gate, up"):
        nb.pack_weight([gate], gated=True)


def test_strided_and_other_dtype_arguments_are_read_as_they_are():
    """The kernels read C-contiguous float32 rows by address (launch.py's words): a strided x is copied first, a
    strided residual (updated in place) or a weight of another dtype takes the reference, and a strided lse_out
    is filled from a contiguous one, each with the results of contiguous float32 arguments."""
    rng = np.random.default_rng(3)
    wide = rng.standard_normal((20, 2 * 96)).astype(np.float32)
    x, w = wide[:, ::2], (1 + 0.1 * rng.standard_normal(96)).astype(np.float32)
    res = rng.standard_normal((20, 96)).astype(np.float32)
    want_n, want_r = nb.add_rms_norm(np.ascontiguousarray(x), res.copy(), w, 1e-6)
    got_n, got_r = nb.add_rms_norm(x, res.copy(), w, 1e-6)
    np.testing.assert_array_equal(got_n, want_n)
    np.testing.assert_array_equal(got_r, want_r)
    res_wide = np.repeat(res, 2, axis=1)
    strided_res = res_wide[:, ::2]
    got_n, got_r = nb.add_rms_norm(np.ascontiguousarray(x), strided_res, w.astype(np.float64), 1e-6)
    assert got_r is strided_res
    np.testing.assert_array_equal(got_r, want_r)  # updated in place, through the view
    tol = 60 * EPS
    np.testing.assert_allclose(got_n, want_n, rtol=tol, atol=tol * float(np.abs(want_n).max()))
    np.testing.assert_allclose(nb.rms_norm(x, w.astype(np.float64), 1e-6), nb.rms_norm(x, w, 1e-6), rtol=tol,
                               atol=tol * float(np.abs(want_n).max()))
    np.testing.assert_array_equal(nb.silu_and_mul(wide[:, ::2]), nb.silu_and_mul(np.ascontiguousarray(wide[:, ::2])))
    logits = rng.standard_normal((5, 300)).astype(np.float32)
    lse, buf = np.empty(5, np.float32), np.full(10, np.nan, np.float32)
    np.testing.assert_array_equal(nb.argmax_rows(logits, lse_out=buf[::2]), nb.argmax_rows(logits, lse_out=lse))
    np.testing.assert_array_equal(buf[::2], lse)
    assert np.isnan(buf[1::2]).all()
