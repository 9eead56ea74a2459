"""The CUDA kernels against the numpy reference ops (GPU only: every test is marked `gpu`).

Tolerances (float16 storage, float32 math):
- paged attention: |gpu - ref| <= 2 fp16 ulps of ref + 1e-5, ref = the numpy op on float32 copies of
  the same float16 data. Long-context outputs are small (|out| ~ 0.02), so 2 ulps is ~3e-5 there,
  four times below what one wrongly included or excluded key changes at an 8k context.
- add/rms norm, silu_and_mul: <= 1 fp16 ulp of the numpy op / a float64 reference; the residual add
  rounds exactly like numpy (bit for bit). rotary: <= 1 ulp of the exact value (the numpy op rounds
  twice, so it is compared with an absolute 4e-3).
- linear: <= 2 fp16 ulps + 1e-3 of a float64 reference (float32 accumulation).
- whole models: logits within 2% of the largest |logit| of the float32 numpy model, and the same top-1
  token on every row whose top-1/top-2 gap exceeds 2% of it.
Batch invariance and masking of never-written slots are checked bit for bit.

Runs under pytest (tests/cupy_kernels/conftest.py skips it without a GPU) or, where pytest is absent,
under tests/cupy_kernels/_mini_runner.py; so: no fixtures, only pytest.mark / raises / skip.
When PAGEDSERVE_GPU_ERRORS names a file, measured errors are appended to it as JSON lines
(scripts/gpu_check.sh collects them into gpu_results.json).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import pytest

from pagedserve.cupy_kernels.cuda import ops as cuda_ops
from pagedserve.cupy_kernels.reference import ops
from pagedserve.cupy_kernels.reference import paged_attention as pa
from pagedserve.cupy_kernels.kernel_set import cuda_kernels
from numerics import f32_tol

DATA = Path(__file__).resolve().parents[1] / "data"
ERRORS_ENV = "PAGEDSERVE_GPU_ERRORS"
f16 = np.float16
cuda = cuda_kernels()  # the CUDA op table: refuses host arrays, so every call below is a device call


def _cp():
    import cupy

    return cupy


def record(name: str, **values) -> None:
    path = os.environ.get(ERRORS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, **{k: float(v) for k, v in values.items()}}) + "\n")


def ulp16(x: np.ndarray) -> np.ndarray:
    """Spacing of float16 numbers at |x| (in float64)."""
    return np.spacing(np.abs(np.asarray(x, dtype=np.float64)).astype(f16)).astype(np.float64)


def max_ulps(got, ref) -> float:
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float((np.abs(got - ref) / ulp16(ref)).max()) if ref.size else 0.0


def to_host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


# ---------------------------------------------------------------------------------------------
# Paged attention
# ---------------------------------------------------------------------------------------------

PAD_BLOCK = 2**30  # block table padding: reading it would be an illegal address, not a silent zero


def build_cache(rng, specs, num_kv, dim, block_size, poison=3e4, spare=7):
    """Caches and metadata for sequences given as (seq_len, num_new) pairs.

    Positions < seq_len hold N(0, 1) data; every other slot holds `poison` (never written by the
    model, so never to be read). Block tables are shuffled across the pool and padded with PAD_BLOCK.
    """
    lens = np.array([s for s, _ in specs], dtype=np.int32)
    news = np.array([n for _, n in specs], dtype=np.int64)
    qsl = np.zeros(len(specs) + 1, dtype=np.int32)
    np.cumsum(news, out=qsl[1:])
    needed = -(-lens // block_size)
    num_blocks = int(needed.sum()) + spare
    perm = rng.permutation(num_blocks)
    tables = np.full((len(specs), int(needed.max()) + 3), PAD_BLOCK, dtype=np.int32)
    at = 0
    for i, nb in enumerate(needed):
        tables[i, :nb] = perm[at: at + nb]
        at += nb
    shape = (num_blocks, block_size, num_kv, dim)
    k = np.full(shape, poison, dtype=f16)
    v = np.full(shape, -poison if np.isfinite(poison) else poison, dtype=f16)
    flat_k = k.reshape(-1, num_kv, dim)
    flat_v = v.reshape(-1, num_kv, dim)
    for i, length in enumerate(lens):
        pos = np.arange(length)
        slots = tables[i, pos // block_size].astype(np.int64) * block_size + pos % block_size
        flat_k[slots] = rng.standard_normal((length, num_kv, dim)).astype(f16)
        flat_v[slots] = rng.standard_normal((length, num_kv, dim)).astype(f16)
    return k, v, qsl, lens, tables


def reference_attention(query, k, v, qsl, lens, tables, scale):
    tables = np.where(tables == PAD_BLOCK, 0, tables)  # the reference never reads padding either
    return pa.paged_attention(query.astype(np.float32), k.astype(np.float32), v.astype(np.float32), qsl, lens,
                              tables, scale)


def gpu_attention(query, k, v, qsl, lens, tables, scale, device_metadata=False):
    cp = _cp()
    meta = (qsl, lens, tables)
    if device_metadata:
        meta = tuple(cp.asarray(m) for m in meta)
    out = cuda.paged_attention(cp.asarray(query), cp.asarray(k), cp.asarray(v), *meta, scale)
    return to_host(out)


def check_attention(got, ref, name):
    err = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    allowed = 2 * ulp16(ref) + 1e-5
    record(name, max_abs_err=err.max(), max_err_over_allowed=(err / allowed).max())
    bad = np.argwhere(err > allowed)
    assert bad.size == 0, f"{name}: {len(bad)} elements off, worst {err.max():.3g} at {bad[0]}"


# Mixed batch: fresh prefills, chunked prefills at long contexts, decodes from 1 to 8k tokens
# (split ones too), a 3-token spec-decode-like chunk.
MIXED = [(1, 1), (7, 7), (40, 40), (100, 33), (8192, 1), (4101, 1), (513, 1), (512, 1), (2000, 300), (17, 1),
         (1030, 3), (600, 600)]
DECODES = [(1, 1), (16, 1), (17, 1), (511, 1), (512, 1), (513, 1), (1024, 1), (4096, 1), (8191, 1), (8192, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_attention_matches_reference(head_dim, block_size, group):
    rng = np.random.default_rng(head_dim + block_size + group)
    num_kv = 2
    scale = head_dim ** -0.5
    for label, specs in (("mixed", MIXED), ("decode", DECODES)):
        k, v, qsl, lens, tables = build_cache(rng, specs, num_kv, head_dim, block_size)
        query = rng.standard_normal((int(qsl[-1]), num_kv * group, head_dim)).astype(f16)
        ref = reference_attention(query, k, v, qsl, lens, tables, scale)
        got = gpu_attention(query, k, v, qsl, lens, tables, scale)
        assert got.dtype == f16 and got.shape == query.shape
        check_attention(got, ref, f"paged_attention/{label}/d{head_dim}/bs{block_size}/g{group}")
        # Device-side metadata (no host checks, partition count bounded by the table width): same bits.
        got_dev = gpu_attention(query, k, v, qsl, lens, tables, scale, device_metadata=True)
        np.testing.assert_array_equal(got_dev, got)


@pytest.mark.gpu
def test_paged_attention_strided_query_view():
    """The model hands in q as a view of the fused qkv projection; strided rows must work."""
    cp = _cp()
    rng = np.random.default_rng(5)
    k, v, qsl, lens, tables = build_cache(rng, [(300, 20), (900, 1)], 2, 64, 16)
    qkv = rng.standard_normal((21, 8 * 64 + 2 * 2 * 64)).astype(f16)
    query = qkv[:, : 8 * 64].reshape(21, 8, 64)
    ref = reference_attention(query, k, v, qsl, lens, tables, 0.125)
    q_dev = cp.asarray(qkv)[:, : 8 * 64].reshape(21, 8, 64)
    got = to_host(cuda.paged_attention(q_dev, cp.asarray(k), cp.asarray(v), qsl, lens, tables, 0.125))
    check_attention(got, ref, "paged_attention/strided_query")


@pytest.mark.gpu
def test_never_written_slots_are_never_read():
    """NaN in every unwritten slot and the tail of every last block: output identical to finite poison."""
    specs = [(5000, 1), (37, 37), (700, 20), (16, 1)]
    got = {}
    for poison in (3e4, np.nan):
        k, v, qsl, lens, tables = build_cache(np.random.default_rng(3), specs, 2, 128, 16, poison=poison)
        query = np.random.default_rng(4).standard_normal((int(qsl[-1]), 8, 128)).astype(f16)
        got[str(poison)] = gpu_attention(query, k, v, qsl, lens, tables, 128 ** -0.5)
    assert np.isfinite(got["nan"]).all()
    np.testing.assert_array_equal(got["nan"], got["30000.0"])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_batch_invariance(head_dim):
    """A sequence alone, in a mixed batch, or in a decode-only batch: bitwise the same output."""
    rng = np.random.default_rng(21)
    group, num_kv, bs = 4, 2, 16
    # Every sequence in one shared cache: A = long split decode, B = prefill chunk, C = short decode,
    # D = a long fresh prefill, E = another split decode.
    specs = {"A": (5000, 1), "B": (300, 50), "C": (100, 1), "D": (700, 700), "E": (2100, 1)}
    names = list(specs)
    k, v, _, lens_all, tables_all = build_cache(rng, list(specs.values()), num_kv, head_dim, bs)
    queries = {n: rng.standard_normal((specs[n][1], num_kv * group, head_dim)).astype(f16) for n in names}
    scale = head_dim ** -0.5

    def run(members):
        idx = [names.index(m) for m in members]
        news = [specs[m][1] for m in members]
        qsl = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
        query = np.concatenate([queries[m] for m in members])
        out = gpu_attention(query, k, v, qsl, lens_all[idx], tables_all[idx], scale)
        return {m: out[qsl[i]: qsl[i + 1]] for i, m in enumerate(members)}

    alone = {m: run([m])[m] for m in names}
    for batch in (["C", "A", "B", "D", "E"], ["E", "D", "C", "B", "A"], ["A", "C", "E"], ["B", "A"]):
        together = run(batch)
        for m in batch:
            np.testing.assert_array_equal(together[m], alone[m], err_msg=f"{m} in batch {batch}")


@pytest.mark.gpu
def test_paged_attention_rejects_unsupported_shapes():
    cp = _cp()
    q = cp.zeros((1, 2, 80), dtype=cp.float16)
    cache = cp.zeros((4, 16, 1, 80), dtype=cp.float16)
    with pytest.raises(ValueError, match="head_dim 80"):
        cuda.paged_attention(q, cache, cache, np.array([0, 1]), np.array([1]), np.zeros((1, 1), np.int32), 1.0)
    cache = cp.zeros((4, 8, 1, 64), dtype=cp.float16)
    with pytest.raises(ValueError, match="block_size 8"):
        cuda.paged_attention(q[:, :, :64], cache, cache, np.array([0, 1]), np.array([1]), np.zeros((1, 1), np.int32), 1.0)  # noqa: E501
    cache = cp.zeros((4, 16, 1, 64), dtype=cp.float16)
    with pytest.raises(IndexError, match="block id"):
        cuda.paged_attention(q[:, :, :64], cache, cache, np.array([0, 1]), np.array([1]), np.full((1, 1), 9, np.int32),
                           1.0)


# ---------------------------------------------------------------------------------------------
# KV cache writes and block copies
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_reshape_and_cache(dtype):
    cp = _cp()
    rng = np.random.default_rng(2)
    num_blocks, bs, kv, d, t = 9, 16, 2, 64, 40
    k_cache = rng.standard_normal((num_blocks, bs, kv, d)).astype(dtype)
    v_cache = rng.standard_normal((num_blocks, bs, kv, d)).astype(dtype)
    slots = rng.permutation(num_blocks * bs)[:t].astype(np.int64)
    slots[[0, 5, 39]] = -1  # skipped
    qkv = rng.standard_normal((t, 4 * d + 2 * kv * d)).astype(dtype)  # key/value are strided views
    key = qkv[:, 4 * d: 4 * d + kv * d].reshape(t, kv, d)
    value = qkv[:, 4 * d + kv * d:].reshape(t, kv, d)
    ref_k, ref_v = k_cache.copy(), v_cache.copy()
    pa.reshape_and_cache(key, value, ref_k, ref_v, slots)
    qkv_d = cp.asarray(qkv)
    got_k, got_v = cp.asarray(k_cache), cp.asarray(v_cache)
    cuda.reshape_and_cache(qkv_d[:, 4 * d: 4 * d + kv * d].reshape(t, kv, d), qkv_d[:, 4 * d + kv * d:].reshape(t, kv, d),  # noqa: E501
                         got_k, got_v, slots)
    np.testing.assert_array_equal(to_host(got_k), ref_k)
    np.testing.assert_array_equal(to_host(got_v), ref_v)
    # Device slot_mapping takes the same path without host checks.
    got_k2, got_v2 = cp.asarray(k_cache), cp.asarray(v_cache)
    cuda.reshape_and_cache(cp.asarray(key), cp.asarray(value), got_k2, got_v2, cp.asarray(slots))
    np.testing.assert_array_equal(to_host(got_k2), ref_k)
    with pytest.raises(IndexError, match="outside a cache"):
        cuda.reshape_and_cache(cp.asarray(key), cp.asarray(value), got_k2, got_v2, np.full(t, num_blocks * bs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_rotary_and_cache(dtype):
    """apply_rotary on qkv's query and key heads, then reshape_and_cache of the rotated key: the value rows equal
    the numpy reference's, the rotated rows agree as apply_rotary's do (one rounding against numpy's two)."""
    cp = _cp()
    rng = np.random.default_rng(4)
    num_blocks, bs, heads, kv, d, t = 9, 16, 4, 2, 64, 40
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    cos, sin = ops.rope_cos_sin(inv_freq, rng.integers(0, 4096, size=t))
    k_cache = rng.standard_normal((num_blocks, bs, kv, d)).astype(dtype)
    v_cache = rng.standard_normal((num_blocks, bs, kv, d)).astype(dtype)
    slots = rng.permutation(num_blocks * bs)[:t].astype(np.int64)
    slots[[0, 5, 39]] = -1  # skipped
    qkv = rng.standard_normal((t, (heads + 2 * kv) * d)).astype(dtype)
    ref_k, ref_v = k_cache.copy(), v_cache.copy()
    ref_q = pa.rotary_and_cache(qkv, heads, kv, cos, sin, ref_k, ref_v, slots)
    got_k, got_v = cp.asarray(k_cache), cp.asarray(v_cache)
    got_q = cuda.rotary_and_cache(cp.asarray(qkv), heads, kv, cos, sin, got_k, got_v, slots)
    atol = 4e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(to_host(got_q).astype(np.float32), ref_q.astype(np.float32), atol=atol)
    np.testing.assert_allclose(to_host(got_k).astype(np.float32), ref_k.astype(np.float32), atol=atol)
    np.testing.assert_array_equal(to_host(got_v), ref_v)
    with pytest.raises(IndexError, match="outside a cache"):
        cuda.rotary_and_cache(cp.asarray(qkv), heads, kv, cos, sin, got_k, got_v, np.full(t, num_blocks * bs))


@pytest.mark.gpu
def test_copy_blocks_all_layers_one_launch():
    cp = _cp()
    rng = np.random.default_rng(3)
    layers = [(rng.standard_normal((10, 16, 2, 64)).astype(f16), rng.standard_normal((10, 16, 2, 64)).astype(f16))
              for _ in range(3)]
    mapping = [(1, 5), (2, 6), (1, 7), (9, 0)]
    ref = [(k.copy(), v.copy()) for k, v in layers]
    pa.copy_blocks(ref, mapping)
    dev = [(cp.asarray(k), cp.asarray(v)) for k, v in layers]
    cuda.copy_blocks(dev, mapping)
    for (rk, rv), (dk, dv) in zip(ref, dev):
        np.testing.assert_array_equal(to_host(dk), rk)
        np.testing.assert_array_equal(to_host(dv), rv)
    cuda.copy_blocks(dev, [])  # no-op
    with pytest.raises(ValueError, match="destination block appears twice"):
        cuda.copy_blocks(dev, [(1, 2), (3, 2)])
    with pytest.raises(IndexError):
        cuda.copy_blocks(dev, [(1, 10)])


def copy_on_write_after_preemption() -> list[tuple[int, int]]:
    """The pending copies of the sequence kv_cache_manager.take_pending_copies warns about: a fork's
    copy X -> Y, then the parent is preempted and frees X, then a later copy-on-write takes X as its
    destination, all before the step applies them."""
    from pagedserve.runtime.core.kv_cache_manager import KVCacheManager

    mgr = KVCacheManager(num_blocks=5, block_size=4)
    assert mgr.allocate_slots("p", 0, 6)  # p: [0, 1], block 1 partly filled
    mgr.fork("p", "c")
    assert mgr.allocate_slots("c", 6, 1)  # c writes into shared block 1: copy (1 -> 2)
    assert mgr.allocate_slots("q", 0, 2)  # q: [3]
    mgr.fork("q", "r")
    assert mgr.allocate_slots("s", 0, 4)  # s: [4]; no free block left
    mgr.free("p")  # p preempted: block 1 (held by p alone now) is free again
    assert mgr.allocate_slots("r", 2, 1)  # r writes into shared block 3: copy (3 -> 1)
    copies = mgr.take_pending_copies()
    assert copies == [(1, 2), (3, 1)], copies
    return copies


@pytest.mark.gpu
def test_copy_blocks_source_freed_and_reused_as_destination():
    """A block that is a source and a destination in one call: numpy reads every source first, so the
    GPU op must too (block 2 gets block 1's old contents, block 1 gets block 3's)."""
    cp = _cp()
    mapping = copy_on_write_after_preemption()
    rng = np.random.default_rng(5)
    for dtype, shape in ((f16, (5, 4, 2, 64)), (np.float32, (5, 4, 1, 3))):  # 3 floats: the byte-wise loop
        layers = [(rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))
                  for _ in range(2)]
        ref = [(k.copy(), v.copy()) for k, v in layers]
        pa.copy_blocks(ref, mapping)
        np.testing.assert_array_equal(ref[0][0][2], layers[0][0][1])
        np.testing.assert_array_equal(ref[0][0][1], layers[0][0][3])
        dev = [(cp.asarray(k), cp.asarray(v)) for k, v in layers]
        cuda.copy_blocks(dev, mapping)
        for (rk, rv), (dk, dv) in zip(ref, dev):
            np.testing.assert_array_equal(to_host(dk), rk)
            np.testing.assert_array_equal(to_host(dv), rv)


@pytest.mark.gpu
def test_kernel_cache_on_disk_serves_a_fresh_process():
    """Modules compiled by NVRTC land in pagedserve's cache dir; a process with empty in-memory tables
    loads them from there (a hit, no compile) and they compute the same thing."""
    import tempfile

    from pagedserve.cupy_kernels.cuda import kernel_cache  # noqa: F401 (must import)

    cp = _cp()
    logits = cp.asarray(np.random.default_rng(0).standard_normal((3, 1000)).astype(np.float32))
    saved = dict(os.environ), dict(cuda_ops._modules), dict(cuda_ops._functions)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            os.environ["PAGEDSERVE_CACHE_DIR"] = tmp
            os.environ["PAGEDSERVE_KERNEL_CACHE"] = "1"
            caches = []
            real = cuda_ops._make_kernel_cache
            cuda_ops._make_kernel_cache = lambda: caches.append(real()) or caches[-1]
            results = []
            for _ in range(2):
                cuda_ops._modules.clear()
                cuda_ops._functions.clear()
                results.append(to_host(cuda_ops.argmax_rows(logits)))
            assert [(c.hits, c.misses) for c in caches] == [(0, 1), (1, 0)]
            assert len(list(Path(tmp, "kernels").glob("*.cubin"))) == 1
            np.testing.assert_array_equal(results[0], results[1])
            np.testing.assert_array_equal(results[0], to_host(logits).argmax(axis=1))
        finally:
            cuda_ops._make_kernel_cache = real
            os.environ.clear()
            os.environ.update(saved[0])
            cuda_ops._modules.clear()
            cuda_ops._modules.update(saved[1])
            cuda_ops._functions.clear()
            cuda_ops._functions.update(saved[2])


# ---------------------------------------------------------------------------------------------
# Elementwise and normalisation ops
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("hidden", [64, 576, 4096, 5000])
def test_add_rms_norm(hidden, dtype):
    cp = _cp()
    rng = np.random.default_rng(hidden)
    rows = 37
    x = (rng.standard_normal((rows, hidden)) * 3).astype(dtype)
    res = rng.standard_normal((rows, hidden)).astype(dtype)
    w = (1 + 0.1 * rng.standard_normal(hidden)).astype(dtype)
    ref_n, ref_r = ops.add_rms_norm(x, res.copy(), w, 1e-6)  # the numpy op updates the residual in place
    res_d = cp.asarray(res)
    got_n, got_r = cuda.add_rms_norm(cp.asarray(x), res_d, cp.asarray(w), 1e-6)
    assert got_r is res_d  # in place, like the numpy op
    np.testing.assert_array_equal(to_host(got_r), ref_r)  # the add rounds exactly like numpy
    if dtype == np.float16:
        ulps = max_ulps(to_host(got_n), ref_n)
        record(f"add_rms_norm/h{hidden}", max_ulps=ulps)
        assert ulps <= 1
    else:
        np.testing.assert_allclose(to_host(got_n), ref_n, rtol=2e-6, atol=1e-6)
    # A residual that is a strided view still works (written to a new array, returned).
    wide = cp.asarray(np.concatenate([res, res], axis=1))
    got_n2, got_r2 = cuda.add_rms_norm(cp.asarray(x), wide[:, :hidden], cp.asarray(w), 1e-6)
    np.testing.assert_array_equal(to_host(got_r2), ref_r)
    np.testing.assert_array_equal(to_host(got_n2), to_host(got_n))
    # No residual yet: x itself is the residual (the same object, as in numpy).
    x_d = cp.asarray(x)
    got_n0, got_r0 = cuda.add_rms_norm(x_d, None, cp.asarray(w), 1e-6)
    assert got_r0 is x_d
    ref_n0 = ops.rms_norm(x, w, 1e-6)
    if dtype == np.float16:
        assert max_ulps(to_host(got_n0), ref_n0) <= 1
        assert max_ulps(to_host(cuda.rms_norm(x_d, cp.asarray(w), 1e-6)), ref_n0) <= 1


@pytest.mark.gpu
def test_apply_rotary():
    """One rounding per output (the numpy op rounds the first product too): <= 1 ulp of the exact value."""
    cp = _cp()
    rng = np.random.default_rng(7)
    t, heads, d = 50, 6, 128
    inv_freq = 1.0 / (500000.0 ** (np.arange(0, d, 2) / d))
    positions = rng.integers(0, 100_000, size=t)
    cos, sin = ops.rope_cos_sin(inv_freq, positions)
    qkv = rng.standard_normal((t, (heads + 4) * d)).astype(f16)
    x = qkv[:, : heads * d].reshape(t, heads, d)  # strided view, as in the model
    x64, c64, s64 = x.astype(np.float64), cos.astype(np.float64)[:, None], sin.astype(np.float64)[:, None]
    exact = np.concatenate([x64[..., : d // 2] * c64 - x64[..., d // 2:] * s64,
                            x64[..., d // 2:] * c64 + x64[..., : d // 2] * s64], axis=-1)
    got = to_host(cuda.apply_rotary(cp.asarray(qkv)[:, : heads * d].reshape(t, heads, d), cos, sin))
    record("apply_rotary", max_ulps_vs_exact=max_ulps(got, exact),
           max_abs_vs_numpy_op=np.abs(got.astype(np.float64) - ops.apply_rotary(x, cos, sin)).max())
    assert max_ulps(got, exact) <= 1
    np.testing.assert_allclose(got, ops.apply_rotary(x, cos, sin), atol=4e-3)
    # cos/sin computed on the device from device positions.
    cos_d, sin_d = cuda.rope_cos_sin(inv_freq, cp.asarray(positions))
    record("rope_cos_sin", max_abs_err=np.abs(to_host(cos_d) - cos).max())
    np.testing.assert_allclose(to_host(cos_d), cos, atol=1e-6)
    np.testing.assert_allclose(to_host(sin_d), sin, atol=1e-6)


@pytest.mark.gpu
def test_logsumexp_rows():
    """The sampler's log-normaliser on the device against the float64 reference (a sum of 49,152 exps)."""
    cp = _cp()
    x = (np.random.default_rng(9).standard_normal((7, 49152)) * 8).astype(np.float32)
    ref = ops.logsumexp_rows(x.astype(np.float64))
    got = to_host(cuda.logsumexp_rows(cp.asarray(x)))
    record("logsumexp_rows", max_abs_err=float(np.abs(got - ref).max()))
    np.testing.assert_allclose(got, ref, rtol=0, atol=f32_tol(float(np.abs(ref).max()), 49152) + 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_silu_and_mul(dtype):
    cp = _cp()
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((33, 2 * 700)) * 4).astype(dtype)
    x[0, :5] = [-100, -30, 0, 30, 100]
    ref = ops.silu_and_mul(x.astype(np.float64)).astype(dtype)
    got = to_host(cuda.silu_and_mul(cp.asarray(x)))
    if dtype == np.float16:
        record("silu_and_mul", max_ulps=max_ulps(got, ref))
        assert max_ulps(got, ref) <= 1
    else:
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_embedding_and_linear():
    cp = _cp()
    rng = np.random.default_rng(9)
    table = rng.standard_normal((300, 64)).astype(f16)
    ids = rng.integers(0, 300, size=25)
    np.testing.assert_array_equal(to_host(cuda.embedding(cp.asarray(table), ids)), table[ids])
    np.testing.assert_array_equal(to_host(cuda.embedding(cp.asarray(table), cp.asarray(ids))), table[ids])
    with pytest.raises(IndexError):
        cuda.embedding(cp.asarray(table), np.array([300]))
    x = rng.standard_normal((19, 4096)).astype(f16)
    w = (rng.standard_normal((1000, 4096)) / 64).astype(f16)  # [out, in], as in a checkpoint
    b = rng.standard_normal(1000).astype(f16)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + b.astype(np.float64)
    for weight_t in (cp.asarray(np.ascontiguousarray(w.T)), cp.asarray(w).T):  # stored [in, out]; a tied view
        got = to_host(cuda.linear(cp.asarray(x), weight_t, cp.asarray(b)))
        err = np.abs(got - ref)
        record("linear", max_abs_err=err.max())
        assert (err <= 2 * ulp16(ref) + 1e-3).all()


@pytest.mark.gpu
def test_linear_accumulates_in_float32():
    """16k positive products: float16 accumulation would be off by tens, float32 by < 1 ulp (4)."""
    cp = _cp()
    rng = np.random.default_rng(10)
    x = rng.random((4, 16384)).astype(f16)
    w = rng.random((8, 16384)).astype(f16)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    got = to_host(cuda.linear(cp.asarray(x), cp.asarray(w).T))
    record("linear/fp32_accumulation", max_abs_err=np.abs(got - ref).max())
    assert np.abs(got - ref).max() <= 4.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_argmax_rows(dtype):
    cp = _cp()
    rng = np.random.default_rng(12)
    logits = rng.standard_normal((9, 50_000)).astype(dtype)
    logits[1, [7, 40_000]] = 50  # tie: first index wins
    logits[2, [123, 9]] = np.nan  # NaN: first NaN wins, as numpy
    logits[3] = -np.inf
    got = to_host(cuda_ops.argmax_rows(cp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=1))


@pytest.mark.gpu
def test_ops_return_device_arrays():
    cp = _cp()
    x = cp.ones((3, 8), dtype=cp.float16)
    assert isinstance(cuda.silu_and_mul(x), cp.ndarray)
    assert isinstance(cuda.linear(x, cp.ones((8, 5), dtype=cp.float16)), cp.ndarray)
    assert isinstance(cuda.rms_norm(x, cp.ones(8, dtype=cp.float16), 1e-6), cp.ndarray)


# ---------------------------------------------------------------------------------------------
# Whole models: GPU (float16) vs the numpy model (float32)
# ---------------------------------------------------------------------------------------------


def _load_tiny(name: str):
    try:  # the loader needs tokenizers; the GPU box may only have numpy + CuPy
        from pagedserve.models.loading.loader import load_model
    except ImportError:
        from pagedserve.models.loading.hf_loader import load_hf_weights

        return load_hf_weights(DATA / name)
    loaded = load_model(DATA / name)
    return loaded.config, loaded.weights


def _random_smollm2_shape():
    from pagedserve.models.config import ModelConfig
    from pagedserve.models.llama import expected_shapes

    cfg = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                      tie_word_embeddings=True)
    rng = np.random.default_rng(0)
    weights = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif "embed" in name:
            weights[name] = rng.standard_normal(shape, dtype=np.float32)
        else:
            weights[name] = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1]))
    return cfg, weights


@functools.lru_cache(maxsize=None)
def _model_pair(name: str):
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.llama import LlamaForCausalLM

    cfg, weights = _random_smollm2_shape() if name == "random-smollm2" else _load_tiny(name)
    return (LlamaForCausalLM(cfg, weights, get_backend("cpu")), LlamaForCausalLM(cfg, weights, get_backend("cuda")))


def _compare_logits(got, ref, name):
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    scale = np.abs(ref).max()
    diff = np.abs(got - ref).max()
    top2 = np.sort(ref, axis=1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 0.02 * scale
    agree = got.argmax(1) == ref.argmax(1)
    record(name, max_abs_diff=diff, max_abs_logit=scale, top1_agreement=agree.mean(),
           decided_rows=decided.sum())
    assert diff <= 0.02 * scale, f"{name}: max |logit diff| {diff:.4g} vs max |logit| {scale:.4g}"
    assert agree[decided].all(), f"{name}: top-1 differs on {(~agree[decided]).sum()} clear-cut rows"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "random-smollm2"])
def test_model_logits_match_numpy(name):
    """Three prompts prefilled in one mixed step (all rows' logits), then decode steps, shuffled
    block tables; GPU logits against the float32 numpy model at every step."""
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.batch import SeqChunk, build_forward_batch
    from pagedserve.models.kv_cache import allocate_kv_caches

    cpu, gpu = _model_pair(name)
    cfg = cpu.config
    rng = np.random.default_rng(1)
    bs = 16
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (5, 37, 120)]
    steps = 4
    num_blocks = sum(-(-(len(p) + steps) // bs) for p in prompts) + 4
    perm = rng.permutation(num_blocks).tolist()
    tables, at = [], 0
    for p in prompts:
        nb = -(-(len(p) + steps) // bs)
        tables.append(perm[at: at + nb])
        at += nb
    kv_cpu = allocate_kv_caches(cfg, num_blocks, bs, get_backend("cpu"))
    kv_gpu = allocate_kv_caches(cfg, num_blocks, bs, get_backend("cuda"))
    tokens = [list(p) for p in prompts]
    batch = build_forward_batch([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], bs)
    batch.logits_indices = np.arange(batch.num_tokens)
    for step in range(steps + 1):
        ref = cpu.forward(batch, kv_cpu)
        got = to_host(gpu.forward(batch, kv_gpu))
        _compare_logits(got, ref, f"model/{name}/step{step}")
        last = ref[-len(prompts):] if step else ref[np.array([len(p) for p in prompts]).cumsum() - 1]
        nxt = last.argmax(1).tolist()
        chunks = []
        for i, tok in enumerate(nxt):
            chunks.append(SeqChunk([tok], len(tokens[i]), tables[i]))
            tokens[i].append(tok)
        batch = build_forward_batch(chunks, bs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_tiny_model_prompt_top1_matches_transformers_goldens(name):
    """Independent check: top-1 of the GPU logits against Hugging Face's (committed goldens), on every
    position where the golden top-1/top-2 gap is clear (> 0.05)."""
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.batch import SeqChunk, build_forward_batch
    from pagedserve.models.kv_cache import allocate_kv_caches

    _, gpu = _model_pair(name)
    g = np.load(DATA / "goldens" / f"{name}.npz")
    agreed = total = 0
    for i in range(int(g["num_prompts"])):
        ids = g[f"prompt_ids_{i}"].tolist()
        kv = allocate_kv_caches(gpu.config, -(-len(ids) // 16) + 1, 16, get_backend("cuda"))
        batch = build_forward_batch([SeqChunk(ids, 0, list(range(len(kv[0][0]))))], 16)
        batch.logits_indices = np.arange(len(ids))
        got = to_host(gpu.forward(batch, kv)).argmax(1)
        top = g[f"topk_logits_{i}"]
        clear = (top[:, 0] - top[:, 1]) > 0.05
        agreed += int((got[clear] == g[f"topk_ids_{i}"][clear, 0]).sum())
        total += int(clear.sum())
    record(f"goldens/{name}", top1_agreement=agreed / max(total, 1))
    assert agreed == total
