"""The GPU tests' shared bodies, as `check_*` functions of a plain module.

tests/cupy_kernels/test_cuda_ops.py and test_gpu_runtime.py run them on a GPU (pytest, or
tests/cupy_kernels/_mini_runner.py where pytest is absent, with tests/ on PYTHONPATH); the host emulation,
tests/cupy_kernels/test_kernels_on_host.py, runs the same functions with a stand-in `cupy` module whose
arrays are numpy's, on the real kernels compiled by g++. So: no fixtures, only pytest.raises / skip, and
every array goes through `import_cupy()` at call time (never a module-level `import cupy`).
tests/runtime/test_sampling_device.py shares the sampler cases with test_gpu_runtime.py.

Tolerances: see test_cuda_ops.py's docstring. When PAGEDSERVE_GPU_ERRORS names a file, measured errors are
appended to it as JSON lines (scripts/gpu_check.sh collects them into gpu_results.json).

Lives in tests/, not tests/cupy_kernels/: a folder named cupy_kernels would shadow the package of that name
under --import-mode=importlib (tests/ is on sys.path through pyproject's pythonpath).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import pytest

from pagedserve.cupy_kernels.cuda import ops as cuda_ops
from pagedserve.cupy_kernels.kernel_set import cuda_kernels
from pagedserve.cupy_kernels.reference import ops
from pagedserve.cupy_kernels.reference import paged_attention as pa

DATA = Path(__file__).resolve().parent / "data"
ERRORS_ENV = "PAGEDSERVE_GPU_ERRORS"
f16 = np.float16
cuda = cuda_kernels()  # the CUDA op table: refuses host arrays, so every call below is a device call
BS = 16  # the block size of the runtime checks


def import_cupy():
    """CuPy, or the host emulation's stand-in while one is installed in sys.modules."""
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
    cp = import_cupy()
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


def check_paged_attention(rng, batches, num_kv, head_dim, block_size, group, name):
    """Each of `batches` ((label, specs) pairs) against the reference, then with device-side metadata
    (no host checks, partition count bounded by the table width): the same bits."""
    scale = head_dim ** -0.5
    for label, specs in batches:
        k, v, qsl, lens, tables = build_cache(rng, specs, num_kv, head_dim, block_size)
        query = rng.standard_normal((int(qsl[-1]), num_kv * group, head_dim)).astype(f16)
        ref = reference_attention(query, k, v, qsl, lens, tables, scale)
        got = gpu_attention(query, k, v, qsl, lens, tables, scale)
        assert got.dtype == f16 and got.shape == query.shape, (got.dtype, got.shape, query.shape)
        check_attention(got, ref, f"{name}/{label}/d{head_dim}/bs{block_size}/g{group}")
        got_dev = gpu_attention(query, k, v, qsl, lens, tables, scale, device_metadata=True)
        np.testing.assert_array_equal(got_dev, got)


def check_paged_attention_strided_query_view():
    """The model hands in q as a view of the fused qkv projection; strided rows must work."""
    cp = import_cupy()
    rng = np.random.default_rng(5)
    k, v, qsl, lens, tables = build_cache(rng, [(300, 20), (900, 1)], 2, 64, 16)
    qkv = rng.standard_normal((21, 8 * 64 + 2 * 2 * 64)).astype(f16)
    query = qkv[:, : 8 * 64].reshape(21, 8, 64)
    ref = reference_attention(query, k, v, qsl, lens, tables, 0.125)
    q_dev = cp.asarray(qkv)[:, : 8 * 64].reshape(21, 8, 64)
    got = to_host(cuda.paged_attention(q_dev, cp.asarray(k), cp.asarray(v), qsl, lens, tables, 0.125))
    check_attention(got, ref, "paged_attention/strided_query")


def check_never_written_slots_are_never_read(specs, num_kv, num_heads, head_dim):
    """NaN in every unwritten slot and the tail of every last block: output identical to finite poison."""
    got = {}
    for poison in (3e4, np.nan):
        k, v, qsl, lens, tables = build_cache(np.random.default_rng(3), specs, num_kv, head_dim, 16, poison=poison)
        query = np.random.default_rng(4).standard_normal((int(qsl[-1]), num_heads, head_dim)).astype(f16)
        got[str(poison)] = gpu_attention(query, k, v, qsl, lens, tables, head_dim ** -0.5)
    assert np.isfinite(got["nan"]).all()
    np.testing.assert_array_equal(got["nan"], got["30000.0"])


def check_batch_invariance(seed, specs, batches, head_dim):
    """Each sequence of `specs` ({name: (seq_len, num_new)}, all in one shared cache) alone and in each of
    `batches`: bitwise the same output."""
    rng = np.random.default_rng(seed)
    group, num_kv = 4, 2
    names = list(specs)
    k, v, _, lens_all, tables_all = build_cache(rng, list(specs.values()), num_kv, head_dim, BS)
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
    for batch in batches:
        together = run(batch)
        for m in batch:
            np.testing.assert_array_equal(together[m], alone[m], err_msg=f"{m} in batch {batch}")


def check_paged_attention_rejects_unsupported_shapes():
    cp = import_cupy()
    q = cp.zeros((1, 2, 80), dtype=cp.float16)
    qsl, lens = np.array([0, 1]), np.array([1])
    cache = cp.zeros((4, 16, 1, 80), dtype=cp.float16)
    with pytest.raises(ValueError, match="head_dim 80"):
        cuda.paged_attention(q, cache, cache, qsl, lens, np.zeros((1, 1), np.int32), 1.0)
    cache = cp.zeros((4, 8, 1, 64), dtype=cp.float16)
    with pytest.raises(ValueError, match="block_size 8"):
        cuda.paged_attention(q[:, :, :64], cache, cache, qsl, lens, np.zeros((1, 1), np.int32), 1.0)
    cache = cp.zeros((4, 16, 1, 64), dtype=cp.float16)
    with pytest.raises(IndexError, match="block id"):
        cuda.paged_attention(q[:, :, :64], cache, cache, qsl, lens, np.full((1, 1), 9, np.int32), 1.0)


# ---------------------------------------------------------------------------------------------
# KV cache writes and block copies
# ---------------------------------------------------------------------------------------------


def check_reshape_and_cache(dtype):
    cp = import_cupy()
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
    key_d = qkv_d[:, 4 * d: 4 * d + kv * d].reshape(t, kv, d)
    value_d = qkv_d[:, 4 * d + kv * d:].reshape(t, kv, d)
    cuda.reshape_and_cache(key_d, value_d, got_k, got_v, slots)
    np.testing.assert_array_equal(to_host(got_k), ref_k)
    np.testing.assert_array_equal(to_host(got_v), ref_v)
    # Device slot_mapping takes the same path without host checks.
    got_k2, got_v2 = cp.asarray(k_cache), cp.asarray(v_cache)
    cuda.reshape_and_cache(cp.asarray(key), cp.asarray(value), got_k2, got_v2, cp.asarray(slots))
    np.testing.assert_array_equal(to_host(got_k2), ref_k)
    with pytest.raises(IndexError, match="outside a cache"):
        cuda.reshape_and_cache(cp.asarray(key), cp.asarray(value), got_k2, got_v2, np.full(t, num_blocks * bs))


def check_rotary_and_cache(dtype):
    """apply_rotary on qkv's query and key heads, then reshape_and_cache of the rotated key: the value rows equal
    the numpy reference's, the rotated rows agree as apply_rotary's do (one rounding against numpy's two)."""
    cp = import_cupy()
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


# ---------------------------------------------------------------------------------------------
# KV cache dtypes (kv_cache_dtype bfloat16, fp8_e4m3, fp8_e5m2 under a float16 model: kv_types.cuh)
# ---------------------------------------------------------------------------------------------


def _kv_storage(kv_cache_dtype):
    from pagedserve.cupy_kernels.kv_layout import kv_cache_layout

    return kv_cache_layout(kv_cache_dtype, np.float16).storage


def _device_kv(cp, a):
    """A cache in the reference's layout on the device: an fp8 one as its uint8 bits (CuPy has no fp8 dtype)."""
    return cp.asarray(a.view(np.uint8) if a.dtype.itemsize == 1 else a)


def _fp8_name(kv_cache_dtype, storage):
    """What the ops are told: an fp8 cache's dtype (uint8 on the device) says nothing; bfloat16's uint16 says it."""
    return kv_cache_dtype if np.dtype(storage).itemsize == 1 else None


def check_kv_dtype_cache_write(kv_cache_dtype):
    """float16 keys and values into a bfloat16 or fp8 cache by reshape_and_cache, and by rotary_and_cache after its
    rotation: the numpy reference's bits (kv_convert.encode: fp8 rows scaled by their max|x| and rounded to nearest
    even, the scale after the codes), with wide ranges, float16's extremes, a subnormal and a row of zeros."""
    from pagedserve.cupy_kernels.reference.kv_convert import encode

    cp = import_cupy()
    storage = _kv_storage(kv_cache_dtype)
    name = _fp8_name(kv_cache_dtype, storage)
    rng = np.random.default_rng(12)
    num_blocks, bs, heads, kv, d, t = 9, 16, 4, 2, 64, 40
    qkv = (rng.standard_normal((t, (heads + 2 * kv) * d)) * rng.uniform(1e-3, 1e3, (t, 1))).astype(f16)
    qkv[3, heads * d: (heads + 1) * d] = 0  # a key row of zeros: scale 0
    qkv[4, -4:] = [65504, -65504, 6e-8, 1.0]
    slots = rng.permutation(num_blocks * bs)[:t].astype(np.int64)
    slots[[0, 5]] = -1
    key = qkv[:, heads * d: (heads + kv) * d].reshape(t, kv, d)
    value = qkv[:, (heads + kv) * d:].reshape(t, kv, d)
    init = encode(rng.standard_normal((num_blocks, bs, kv, d)).astype(np.float32), storage)
    ref_k, ref_v = init.copy(), init.copy()
    pa.reshape_and_cache(key, value, ref_k, ref_v, slots)
    assert (ref_k.view(np.uint8) != init.view(np.uint8)).any()
    got_k, got_v = _device_kv(cp, init), _device_kv(cp, init)
    qkv_d = cp.asarray(qkv)
    cuda.reshape_and_cache(qkv_d[:, heads * d: (heads + kv) * d].reshape(t, kv, d),
                           qkv_d[:, (heads + kv) * d:].reshape(t, kv, d), got_k, got_v, slots, kv_cache_dtype=name)
    np.testing.assert_array_equal(to_host(got_k).view(np.uint8), ref_k.view(np.uint8))
    np.testing.assert_array_equal(to_host(got_v).view(np.uint8), ref_v.view(np.uint8))
    # rotary_and_cache: the key rotated on the device (apply_rotary), then written as reshape_and_cache writes it
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    cos, sin = ops.rope_cos_sin(inv_freq, rng.integers(0, 4096, size=t))
    got_k, got_v = _device_kv(cp, init), _device_kv(cp, init)
    cuda.rotary_and_cache(cp.asarray(qkv), heads, kv, cos, sin, got_k, got_v, slots, kv_cache_dtype=name)
    rotated = to_host(cuda.apply_rotary(qkv_d[:, heads * d: (heads + kv) * d].reshape(t, kv, d), cos, sin))
    ref_k, ref_v = init.copy(), init.copy()
    pa.reshape_and_cache(rotated, value, ref_k, ref_v, slots)
    np.testing.assert_array_equal(to_host(got_k).view(np.uint8), ref_k.view(np.uint8))
    np.testing.assert_array_equal(to_host(got_v).view(np.uint8), ref_v.view(np.uint8))


def check_kv_dtype_attention(rng, kv_cache_dtype, batches, num_kv, head_dim, block_size, group, window=None):
    """A float16 query over bfloat16 or fp8 caches (converted in the attention loop): the numpy reference over the
    same stored values decoded (kv_convert.decode) within check_attention's float16 bound, and not the float16
    caches' result (the storage rounding is really there)."""
    from pagedserve.cupy_kernels.reference.kv_convert import decode, encode

    cp = import_cupy()
    storage = _kv_storage(kv_cache_dtype)
    scale = head_dim ** -0.5
    for label, specs in batches:
        k, v, qsl, lens, tables = build_cache(rng, specs, num_kv, head_dim, block_size)
        k8, v8 = encode(k.astype(np.float32), storage), encode(v.astype(np.float32), storage)
        query = rng.standard_normal((int(qsl[-1]), num_kv * group, head_dim)).astype(f16)
        host_tables = np.where(tables == PAD_BLOCK, 0, tables)
        ref = pa.paged_attention(query.astype(np.float32), decode(k8), decode(v8), qsl, lens, host_tables, scale,
                                 sliding_window=window)
        got = to_host(cuda.paged_attention(cp.asarray(query), _device_kv(cp, k8), _device_kv(cp, v8), qsl, lens,
                                           tables, scale, sliding_window=window,
                                           kv_cache_dtype=_fp8_name(kv_cache_dtype, storage)))
        assert got.dtype == f16 and got.shape == query.shape
        check_attention(got, ref, f"kv_{kv_cache_dtype}/{label}/d{head_dim}/bs{block_size}/g{group}/w{window}")
        f16_ref = pa.paged_attention(query.astype(np.float32), k.astype(np.float32), v.astype(np.float32), qsl, lens,
                                     host_tables, scale, sliding_window=window)
        assert np.abs(got.astype(np.float64) - f16_ref).max() > 2 * ulp16(f16_ref).max()


def check_kv_dtype_refusals():
    """Bad kv_cache_dtype input to the CUDA ops: a clear ValueError naming the value and the choices."""
    from pagedserve.cupy_kernels.cuda import attention as cuda_attention

    cp = import_cupy()
    q = cp.zeros((1, 2, 64), dtype=cp.float16)
    qsl, lens, tables = np.array([0, 1]), np.array([1]), np.zeros((1, 1), np.int32)
    fp8 = cp.zeros((4, 16, 1, 68), dtype=cp.uint8)
    with pytest.raises(ValueError, match="needs kv_cache_dtype"):
        cuda.paged_attention(q, fp8, fp8, qsl, lens, tables, 1.0)
    with pytest.raises(ValueError, match="'int8' has no CUDA kernels; choose one of float16, bfloat16, fp8_e4m3"):
        cuda.paged_attention(q, fp8, fp8, qsl, lens, tables, 1.0, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="a bfloat16 cache cannot be an array of uint8"):
        cuda.paged_attention(q, fp8, fp8, qsl, lens, tables, 1.0, kv_cache_dtype="bfloat16")
    short = cp.zeros((4, 16, 1, 64), dtype=cp.uint8)  # rows without room for their scale
    with pytest.raises(ValueError, match=r"query must be \[T, H, 60\]"):
        cuda.paged_attention(q, short, short, qsl, lens, tables, 1.0, kv_cache_dtype="fp8_e4m3")
    wide = cp.zeros((1, 32, 64), dtype=cp.float16)  # 32 query heads on one kv head: the 32-row tile fp8 lacks
    with pytest.raises(ValueError, match="32 query heads per kv head over an fp8 cache; .* at most 16"):
        cuda.paged_attention(wide, fp8, fp8, qsl, lens, tables, 1.0, kv_cache_dtype="fp8_e5m2")
    bf16 = cp.zeros((4, 16, 1, 64), dtype=np.uint16)
    with pytest.raises(ValueError, match="prefill_attention: reads caches of the query's dtype only"):
        cuda_attention.prefill_attention(q, bf16, bf16, qsl, lens, tables, 1.0)


def check_copy_blocks_all_layers_one_launch():
    cp = import_cupy()
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


def check_copy_blocks_source_freed_and_reused_as_destination():
    """A block that is a source and a destination in one call: numpy reads every source first, so the
    GPU op must too (block 2 gets block 1's old contents, block 1 gets block 3's)."""
    cp = import_cupy()
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


# ---------------------------------------------------------------------------------------------
# Elementwise and normalisation ops
# ---------------------------------------------------------------------------------------------


def check_add_rms_norm(hidden, dtype):
    cp = import_cupy()
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
        assert ulps <= 1, ulps
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
        ulps0 = max_ulps(to_host(got_n0), ref_n0)
        assert ulps0 <= 1, ulps0
        ulps_rms = max_ulps(to_host(cuda.rms_norm(x_d, cp.asarray(w), 1e-6)), ref_n0)
        assert ulps_rms <= 1, ulps_rms


def check_apply_rotary():
    """One rounding per output (the numpy op rounds the first product too): <= 1 ulp of the exact value."""
    cp = import_cupy()
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
    assert max_ulps(got, exact) <= 1, max_ulps(got, exact)
    np.testing.assert_allclose(got, ops.apply_rotary(x, cos, sin), atol=4e-3)
    # cos/sin computed on the device from device positions.
    cos_d, sin_d = cuda.rope_cos_sin(inv_freq, cp.asarray(positions))
    record("rope_cos_sin", max_abs_err=np.abs(to_host(cos_d) - cos).max())
    np.testing.assert_allclose(to_host(cos_d), cos, atol=1e-6)
    np.testing.assert_allclose(to_host(sin_d), sin, atol=1e-6)


def check_silu_and_mul(dtype):
    cp = import_cupy()
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((33, 2 * 700)) * 4).astype(dtype)
    x[0, :5] = [-100, -30, 0, 30, 100]
    ref = ops.silu_and_mul(x.astype(np.float64)).astype(dtype)
    got = to_host(cuda.silu_and_mul(cp.asarray(x)))
    if dtype == np.float16:
        record("silu_and_mul", max_ulps=max_ulps(got, ref))
        assert max_ulps(got, ref) <= 1, max_ulps(got, ref)
    else:
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


def check_argmax_rows(dtype):
    cp = import_cupy()
    rng = np.random.default_rng(12)
    logits = rng.standard_normal((9, 50_000)).astype(dtype)
    logits[1, [7, 40_000]] = 50  # tie: first index wins
    logits[2, [123, 9]] = np.nan  # NaN: first NaN wins, as numpy
    logits[3] = -np.inf
    got = to_host(cuda_ops.argmax_rows(cp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=1))


def check_ops_write_into_out():
    """Each op a decode graph's forward calls, given `out=` (and `workspace=` for its scratch: models/workspace.py),
    writes the bits it returns without them, into those very buffers; a wrong `out` is refused naming the op. The
    kernels that replaced CuPy expressions (issue 59): the embedding gather (the table's bits), the float32 widening
    of the logits (astype's bits), rope cos/sin (the float64 reference within float32 rounding)."""
    from pagedserve.models.workspace import Workspace

    cp = import_cupy()
    rng = np.random.default_rng(21)
    ws = Workspace(cp)

    def same(got, want, buffer):
        assert got.data.ptr == buffer.data.ptr
        np.testing.assert_array_equal(to_host(got), to_host(want))

    for dtype in (f16, np.float32):
        table = rng.standard_normal((300, 64)).astype(dtype)
        ids = rng.integers(0, 300, size=25)
        buf = cp.empty((25, 64), dtype=dtype)
        same(cuda_ops.embedding(cp.asarray(table), cp.asarray(ids), out=buf), cp.asarray(table[ids]), buf)
        np.testing.assert_array_equal(to_host(cuda_ops.embedding(cp.asarray(table), ids)), table[ids])
    np.testing.assert_array_equal(to_host(cuda_ops.embedding(cp.asarray(table), np.array([-1, 0]))), table[[-1, 0]])
    x = rng.standard_normal((7, 96)).astype(f16)
    wide = cp.empty((7, 96), dtype=cp.float32)
    same(cuda_ops.to_float32(cp.asarray(x), out=wide), cp.asarray(x.astype(np.float32)), wide)
    w = (rng.standard_normal((96, 40)) / 10).astype(f16)
    logits = cp.empty((7, 40), dtype=cp.float32)
    got = cuda_ops.linear(cp.asarray(x), cp.asarray(w), out=logits, workspace=ws)
    same(got, cuda_ops.linear(cp.asarray(x), cp.asarray(w)).astype(np.float32), logits)
    inv_freq, positions = 1.0 / (10000.0 ** (np.arange(0, 64, 2) / 64)), rng.integers(0, 100_000, size=7)
    pair = (cp.empty((7, 32), dtype=cp.float32), cp.empty((7, 32), dtype=cp.float32))
    cos, sin = cuda_ops.rope_cos_sin(inv_freq, cp.asarray(positions), out=pair)
    ref_cos, ref_sin = ops.rope_cos_sin(inv_freq, positions)
    assert cos.data.ptr == pair[0].data.ptr and sin.data.ptr == pair[1].data.ptr
    np.testing.assert_allclose(to_host(cos), ref_cos, rtol=0, atol=1e-6)
    np.testing.assert_allclose(to_host(sin), ref_sin, rtol=0, atol=1e-6)
    h = cp.asarray(x[:, :64])
    normed = cp.empty((7, 64), dtype=cp.float16)
    weight = cp.asarray(np.ones(64, f16))
    same(cuda_ops.rms_norm(h, weight, 1e-6, out=normed), cuda_ops.rms_norm(h, weight, 1e-6), normed)
    act = cp.empty((7, 48), dtype=cp.float16)
    same(cuda_ops.silu_and_mul(cp.asarray(x), out=act), cuda_ops.silu_and_mul(cp.asarray(x)), act)
    heads = cp.asarray(x).reshape(7, 3, 32)
    rotated = cp.empty((7, 3, 32), dtype=cp.float16)
    c16, s16 = ops.rope_cos_sin(inv_freq[:16], positions)
    same(cuda_ops.apply_rotary(heads, c16, s16, out=rotated), cuda_ops.apply_rotary(heads, c16, s16), rotated)
    with pytest.raises(ValueError, match="silu_and_mul: out must be"):
        cuda_ops.silu_and_mul(cp.asarray(x), out=cp.empty((7, 47), dtype=cp.float16))
    # Paged attention into `out`, its split-decode partials in the workspace: the bits of a plain call.
    k, v, qsl, lens, tables = build_cache(rng, [(700, 1), (37, 1), (20, 20)], 2, 64, 16)
    query = cp.asarray(rng.standard_normal((int(qsl[-1]), 4, 64)).astype(f16))
    dev = [cp.asarray(a) for a in (k, v, qsl, lens, tables)]
    attn = cp.empty(query.shape, dtype=cp.float16)
    want = cuda_ops.paged_attention(query, *dev, 0.125)
    same(cuda_ops.paged_attention(query, *dev, 0.125, out=attn, workspace=ws), want, attn)
    assert ws.buffers["attention_partials"].dtype == np.float32
    # rotary_and_cache: the query into `out`, the rotated key through the workspace, the cache as a plain call writes.
    qkv = cp.asarray(rng.standard_normal((3, (4 + 2 * 2) * 64)).astype(f16))
    slots = cp.asarray(np.array([5, -1, 40], np.int64))
    c3, s3 = ops.rope_cos_sin(1.0 / (10000.0 ** (np.arange(0, 64, 2) / 64)), np.array([5, 9, 40]))
    caches = [(cp.asarray(k), cp.asarray(v)) for _ in range(2)]
    q_out = cp.empty((3, 4, 64), dtype=cp.float16)
    got = cuda_ops.rotary_and_cache(qkv, 4, 2, c3, s3, *caches[0], slots, out=q_out, workspace=ws)
    same(got, cuda_ops.rotary_and_cache(qkv, 4, 2, c3, s3, *caches[1], slots), q_out)
    for a, b in zip(caches[0], caches[1]):
        np.testing.assert_array_equal(to_host(a), to_host(b))


def check_ops_return_device_arrays():
    cp = import_cupy()
    x = cp.ones((3, 8), dtype=cp.float16)
    assert isinstance(cuda.silu_and_mul(x), cp.ndarray)
    assert isinstance(cuda.linear(x, cp.ones((8, 5), dtype=cp.float16)), cp.ndarray)
    assert isinstance(cuda.rms_norm(x, cp.ones(8, dtype=cp.float16), 1e-6), cp.ndarray)


# ---------------------------------------------------------------------------------------------
# Whole models: GPU (float16) vs the numpy model (float32)
# ---------------------------------------------------------------------------------------------


def load_tiny(name: str):
    """A committed tiny checkpoint; "<name>-bias": that Llama with attention_bias (random q/k/v and o_proj biases)."""
    if name.endswith("-bias"):
        import dataclasses

        cfg, weights = load_tiny(name.removesuffix("-bias"))
        rng = np.random.default_rng(2)
        sizes = {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size, "o_proj": cfg.hidden_size}
        for n in range(cfg.num_hidden_layers):
            for proj, size in sizes.items():
                bias = 0.5 * rng.standard_normal(size)
                weights[f"model.layers.{n}.self_attn.{proj}.bias"] = bias.astype(np.float32)
        return dataclasses.replace(cfg, attention_bias=True, o_proj_bias=True), weights
    try:  # the loader needs tokenizers; the GPU box may only have numpy + CuPy
        from pagedserve.models.loading.loader import load_model
    except ImportError:
        from pagedserve.models.loading.hf_loader import load_hf_weights

        return load_hf_weights(DATA / name)
    loaded = load_model(DATA / name)
    return loaded.config, loaded.weights


def random_smollm2_shape():
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
def model_pair(name: str):
    """(numpy model, CUDA model) of one checkpoint. The host emulation clears this cache around each test:
    a model holds arrays of the `cupy` it was built under."""
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models import registry

    cfg, weights = random_smollm2_shape() if name == "random-smollm2" else load_tiny(name)
    model_class = registry.for_config(cfg).model_class  # the family's class (tiny-gemma3: Gemma3ForCausalLM, ...)
    return (model_class(cfg, weights, get_backend("cpu")), model_class(cfg, weights, get_backend("cuda")))


def compare_logits(got, ref, name):
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


def check_model_logits_match_numpy(name):
    """Three prompts prefilled in one mixed step (all rows' logits), then decode steps, shuffled
    block tables; GPU logits against the float32 numpy model at every step."""
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.batch import SeqChunk, build_forward_batch
    from pagedserve.models.kv_cache import allocate_kv_caches

    cpu, gpu = model_pair(name)
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
        compare_logits(got, ref, f"model/{name}/step{step}")
        last = ref[-len(prompts):] if step else ref[np.array([len(p) for p in prompts]).cumsum() - 1]
        nxt = last.argmax(1).tolist()
        chunks = []
        for i, tok in enumerate(nxt):
            chunks.append(SeqChunk([tok], len(tokens[i]), tables[i]))
            tokens[i].append(tok)
        batch = build_forward_batch(chunks, bs)


# ---------------------------------------------------------------------------------------------
# The runtime above the kernels: device metadata, CUDA graph replays, the engine
# ---------------------------------------------------------------------------------------------


def prefill(model, kv_list, lens, tables, seed=0):
    from pagedserve.models.batch import SeqChunk, build_forward_batch

    rng = np.random.default_rng(seed)
    batch = build_forward_batch([SeqChunk(rng.integers(0, model.config.vocab_size, n).tolist(), 0, t)
                                 for n, t in zip(lens, tables)], BS)
    return [to_host(model.forward(batch, kv)) for kv in kv_list]


def decode_batch(lens, tables, rows, vocab):
    from pagedserve.models.batch import SeqChunk, build_forward_batch

    return build_forward_batch([SeqChunk([(7 * i) % vocab], lens[i], tables[i]) for i in rows], BS)


def check_device_metadata_and_table_width_change_nothing():
    """Host metadata (checked, trimmed, uploaded once by the forward) and device metadata with tables
    four times wider than needed give bit-identical logits: the attention's partition split depends
    on each sequence's length only."""
    cp = import_cupy()
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.device_batch import pack_batch, unpack_batch
    from pagedserve.models.kv_cache import allocate_kv_caches

    _, gpu = model_pair("tiny-llama")
    lens, tables = [700, 33, 5], [list(range(0, 44)), list(range(44, 47)), [47]]
    kv_a = allocate_kv_caches(gpu.config, 64, BS, get_backend("cuda"))
    prefill(gpu, [kv_a], lens, tables)
    kv_b = [(k.copy(), v.copy()) for k, v in kv_a]
    for step in range(3):
        batch = decode_batch([n + step for n in lens], tables, [0, 1, 2], gpu.config.vocab_size)
        ref = to_host(gpu.forward(batch, kv_a))
        i64, i32, layout = pack_batch(batch, 4 * 44)
        got = to_host(gpu.forward(unpack_batch(cp.asarray(i64), cp.asarray(i32), layout), kv_b))
        np.testing.assert_array_equal(got, ref)


def check_decode_graph_replays(name: str, capturer=None):
    """Graph replays against eager steps on two copies of one KV cache. `capturer`: CupyGraphCapturer
    on a GPU; test_kernels_on_host.py passes a fake to run the same check on the emulated kernels."""
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.kv_cache import allocate_kv_caches
    from pagedserve.runtime.worker.cuda_graphs import CupyGraphCapturer, DecodeGraphs

    _, gpu = model_pair(name)
    cfg = gpu.config
    max_model_len = 1024
    lens = [700, 37, 120, 5, 300, 64, 1, 530]  # 700 and 530 decode in two partitions
    tables, at = [], 0
    for n in lens:
        nb = -(-(n + 16) // BS)
        tables.append(list(range(at, at + nb)))
        at += nb
    kv_e = allocate_kv_caches(cfg, at + 8, BS, get_backend("cuda"))
    prefill(gpu, [kv_e], lens, tables)
    kv_g = [(k.copy(), v.copy()) for k, v in kv_e]
    graphs = DecodeGraphs(gpu, kv_g, (1, 2, 4, 8), -(-max_model_len // BS), capturer or CupyGraphCapturer())
    assert graphs.capture_all(), graphs.disabled_reason
    # 1. batches of exactly a captured size: the same kernels on the same shapes. Checked within
    # tolerance first (a wrong replay is far off), then bit for bit, which also needs cuBLAS to pick
    # the same GEMM algorithm under capture as eagerly (reported last, with its own message).
    bitwise = []
    for step, rows in enumerate([list(range(8)), [0, 1, 2, 3], [4, 5, 6, 7], [3], [6, 1]]):
        batch = decode_batch(lens, tables, rows, cfg.vocab_size)
        ref = to_host(gpu.forward(batch, kv_e))
        got = to_host(graphs.run(batch))
        assert got.shape == ref.shape, (got.shape, ref.shape)
        compare_logits(got, ref, f"graphs/{name}/exact{step}")
        same = bool(np.array_equal(got, ref))
        for layer, ((ke, ve), (kg, vg)) in enumerate(zip(kv_e, kv_g)):
            for what, e, g in (("K", ke, kg), ("V", ve, vg)):
                e, g = to_host(e).astype(np.float32), to_host(g).astype(np.float32)
                gap = float(np.abs(e - g).max())
                assert gap <= 0.02 * float(np.abs(e).max()) + 1e-3, \
                    f"{name}: {what} cache of layer {layer} differs by {gap} after step {step} (a stray write?)"
                same = same and gap == 0.0
        bitwise.append(same)
        for i in rows:
            lens[i] += 1
        if step == 1:  # eager work between replays must not land in the graphs' memory, nor they in its
            scratch = allocate_kv_caches(cfg, 40, BS, get_backend("cuda"))
            prefill(gpu, [scratch], [300, 100], [list(range(19)), list(range(19, 26))], seed=9)
            del scratch
    # 2. padded batches: row results may differ in the last bits (cuBLAS picks per M)
    worst = 0.0
    for step, rows in enumerate([[0, 1, 2], [0, 2, 4, 5, 7], [1, 3, 5, 6, 7]]):
        batch = decode_batch(lens, tables, rows, cfg.vocab_size)
        ref = to_host(gpu.forward(batch, kv_e))
        got = to_host(graphs.run(batch))
        assert got.shape == ref.shape, (got.shape, ref.shape)
        compare_logits(got, ref, f"graphs/{name}/padded{step}")
        worst = max(worst, float(np.abs(got - ref).max()))
        for i in rows:
            lens[i] += 1
    record(f"graphs/{name}", padded_max_abs_diff=worst, replays=graphs.num_replays,
           capture_seconds=graphs.capture_seconds, exact_steps_bitwise=float(all(bitwise)))
    assert graphs.num_replays == 8, graphs.num_replays
    assert all(bitwise), (f"{name}: exact-size replays are close to the eager steps but not bit-identical "
                          f"(per step: {bitwise}); cuBLAS likely chose another GEMM algorithm under capture")


def tiny_loaded():
    """tiny-llama through the full loader; skips without the engine's optional dependencies."""
    try:
        import structlog  # noqa: F401
        import tokenizers  # noqa: F401
        from pagedserve.models.loading.loader import load_model
    except ImportError as e:
        pytest.skip(f"the engine needs its optional dependencies: {e}")
    return load_model(DATA / "tiny-llama")


def generate(engine, requests):
    """Run `requests` ((id, prompt, params) triples) to the end: {id: [(token_ids, cumulative_logprob)]}."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(5_000):  # bounded (the GPU files also run under _mini_runner, without engine_helpers' pytest.fail)
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.cumulative_logprob) for c in out.outputs]
    assert not engine.has_unfinished_requests(), "requests still unfinished after 5,000 steps"
    return done


# ---------------------------------------------------------------------------------------------
# The sampler's device path: cases shared by tests/runtime/test_sampling_device.py (numpy standing in
# for CuPy) and test_gpu_runtime.py (real CuPy)
# ---------------------------------------------------------------------------------------------

# Rows whose draws walk the same order on the device and the host: greedy, top-k and whole-row draws.
# The top-p rows (3, 7) draw in token order on the device, in probability order on the host.
SAME_ORDER_ROWS = [0, 1, 2, 4, 5, 6]
TOP_P_ROWS = (3, 7)


def sampler_logits(rows, vocab, seed=0):
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * 3).astype(np.float32)


def sampler_params():
    from pagedserve.runtime.sampling_params import SamplingParams

    return [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=40, seed=1),
        SamplingParams(temperature=1.0, top_k=2000, seed=2, logprobs=0),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3, logprobs=5),
        SamplingParams(temperature=1.0, top_p=0.8, top_k=100, seed=4),
        SamplingParams(temperature=1.0, min_p=0.05, seed=5, repetition_penalty=1.2),
        SamplingParams(temperature=1.0, seed=6, presence_penalty=0.5),
        SamplingParams(temperature=0.9, top_p=0.5, min_p=0.1, seed=7),
    ]


def run_sampler(xp, logits, params):
    """One Sampler call on `logits` (an array of `xp`), with fixed prompts, outputs and one banned token."""
    from pagedserve.runtime.sample.sampler import Sampler

    gens = [np.random.default_rng(p.seed) if p.seed is not None else None for p in params]
    n = len(params)
    banned = [[], [7]] + [[] for _ in range(n - 2)]
    return Sampler(0)(logits, params, gens, [[1, 2, 3]] * n, [[5, 5, 9]] * n, xp=xp, banned_token_ids=banned)


def check_device_tokens_against_host(dev, host, logits, params):
    """The device path's tokens where both paths walk the same order, top-p draws inside the nucleus, and
    row 3's top logprob tokens as the host's."""
    from pagedserve.runtime.sample import sampling_device

    np.testing.assert_array_equal(dev.token_ids[SAME_ORDER_ROWS], host.token_ids[SAME_ORDER_ROWS])
    for b in TOP_P_ROWS:
        x = logits[b] / params[b].temperature
        keep, _ = sampling_device.nucleus_mask(x[None], np.array([params[b].top_p], np.float32), np)
        assert keep[0, dev.token_ids[b]], f"row {b}: token {dev.token_ids[b]} outside the nucleus"
    assert [t for t, _ in dev.top_logprobs[3]] == [t for t, _ in host.top_logprobs[3]]
