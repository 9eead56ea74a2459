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
under tests/cupy_kernels/_mini_runner.py; so: no fixtures, only pytest.mark / raises / skip. The bodies
shared with the host emulation (test_kernels_on_host.py) are tests/gpu_helpers.py's check_* functions.
When PAGEDSERVE_GPU_ERRORS names a file, measured errors are appended to it as JSON lines
(scripts/gpu_check.sh collects them into gpu_results.json).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import gpu_helpers
from gpu_helpers import DATA, cuda, f16, import_cupy as _cp, model_pair, record, to_host, ulp16
from numerics import f32_tol
from pagedserve.cupy_kernels.cuda import modules as cuda_modules, ops as cuda_ops
from pagedserve.cupy_kernels.reference import ops



# ---------------------------------------------------------------------------------------------
# Paged attention
# ---------------------------------------------------------------------------------------------

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
    gpu_helpers.check_paged_attention(rng, (("mixed", MIXED), ("decode", DECODES)), 2, head_dim, block_size, group,
                                      "paged_attention")


@pytest.mark.gpu
@pytest.mark.parametrize("group,block_size", [(4, 16), (16, 32), (24, 16)])
def test_paged_attention_head_dim_256(group, block_size):
    """Head dim 256 (Gemma 3), BLOCK_M 4 to 32: the chunks' tiles (BLOCK_M 16 and 32) take dynamic shared memory past
    48 KB, the kernel opted in. Group 4 is Gemma 3 270M's (4 query heads, 1 kv head); 24 pads BLOCK_M 32."""
    rng = np.random.default_rng(group + block_size)
    gpu_helpers.check_paged_attention(rng, (("mixed", MIXED), ("decode", DECODES)), 1, 256, block_size, group,
                                      "paged_attention")


@pytest.mark.gpu
@pytest.mark.parametrize("window", [37, 512, 1000])
def test_sliding_window_head_dim_256(window):
    """Gemma 3's shape (4 query heads, 1 kv head, head dim 256; window 512) against numpy with the same window:
    split decodes whose window spans partitions, chunks deep in a context."""
    from pagedserve.cupy_kernels.reference import paged_attention as pa

    cp = _cp()
    rng = np.random.default_rng(window)
    k, v, qsl, lens, tables = gpu_helpers.build_cache(rng, MIXED, 1, 256, 16)
    query = rng.standard_normal((int(qsl[-1]), 4, 256)).astype(f16)
    ref = pa.paged_attention(query.astype(np.float32), k.astype(np.float32), v.astype(np.float32), qsl, lens,
                             np.where(tables == gpu_helpers.PAD_BLOCK, 0, tables), 1 / 16, sliding_window=window)
    got = to_host(cuda.paged_attention(cp.asarray(query), cp.asarray(k), cp.asarray(v), qsl, lens, tables, 1 / 16,
                                       sliding_window=window))
    gpu_helpers.check_attention(got, ref, f"paged_attention/d256/window{window}")


@pytest.mark.gpu
def test_paged_attention_strided_query_view():
    gpu_helpers.check_paged_attention_strided_query_view()


@pytest.mark.gpu
def test_never_written_slots_are_never_read():
    gpu_helpers.check_never_written_slots_are_never_read([(5000, 1), (37, 37), (700, 20), (16, 1)], 2, 8, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_batch_invariance(head_dim):
    """A sequence alone, in a mixed batch, or in a decode-only batch: bitwise the same output.
    A = long split decode, B = prefill chunk, C = short decode, D = a long fresh prefill, E = another
    split decode."""
    specs = {"A": (5000, 1), "B": (300, 50), "C": (100, 1), "D": (700, 700), "E": (2100, 1)}
    batches = (["C", "A", "B", "D", "E"], ["E", "D", "C", "B", "A"], ["A", "C", "E"], ["B", "A"])
    gpu_helpers.check_batch_invariance(21, specs, batches, head_dim)


@pytest.mark.gpu
def test_paged_attention_rejects_unsupported_shapes():
    gpu_helpers.check_paged_attention_rejects_unsupported_shapes()


# ---------------------------------------------------------------------------------------------
# KV cache writes and block copies
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_kv_dtype_cache_write(kv_cache_dtype):
    gpu_helpers.check_kv_dtype_cache_write(kv_cache_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("head_dim,block_size,group,window", [(64, 16, 1, None), (128, 32, 4, 300), (256, 16, 8, None)])
def test_kv_dtype_attention(kv_cache_dtype, head_dim, block_size, group, window):
    specs = [(1, 1), (7, 7), (40, 40), (100, 33), (1100, 1), (513, 1), (700, 45), (17, 1), (530, 3)]
    gpu_helpers.check_kv_dtype_attention(np.random.default_rng(head_dim + group), kv_cache_dtype, (("mixed", specs),),
                                         2, head_dim, block_size, group, window)


@pytest.mark.gpu
def test_kv_dtype_refusals():
    gpu_helpers.check_kv_dtype_refusals()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_reshape_and_cache(dtype):
    gpu_helpers.check_reshape_and_cache(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_rotary_and_cache(dtype):
    gpu_helpers.check_rotary_and_cache(dtype)


@pytest.mark.gpu
def test_copy_blocks_all_layers_one_launch():
    gpu_helpers.check_copy_blocks_all_layers_one_launch()


@pytest.mark.gpu
def test_copy_blocks_source_freed_and_reused_as_destination():
    gpu_helpers.check_copy_blocks_source_freed_and_reused_as_destination()


@pytest.mark.gpu
def test_kernel_cache_on_disk_serves_a_fresh_process():
    """Modules compiled by NVRTC land in pagedserve's cache dir; a process with empty in-memory tables
    loads them from there (a hit, no compile) and they compute the same thing."""
    import tempfile

    from pagedserve.cupy_kernels.cuda import kernel_cache  # noqa: F401 (must import)

    cp = _cp()
    logits = cp.asarray(np.random.default_rng(0).standard_normal((3, 1000)).astype(np.float32))
    saved = dict(os.environ), dict(cuda_modules._modules), dict(cuda_modules._functions)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            os.environ["PAGEDSERVE_CACHE_DIR"] = tmp
            os.environ["PAGEDSERVE_KERNEL_CACHE"] = "1"
            caches = []
            real = cuda_modules._make_kernel_cache
            cuda_modules._make_kernel_cache = lambda: caches.append(real()) or caches[-1]
            results = []
            for _ in range(2):
                cuda_modules._modules.clear()
                cuda_modules._functions.clear()
                results.append(to_host(cuda_ops.argmax_rows(logits)))
            assert [(c.hits, c.misses) for c in caches] == [(0, 1), (1, 0)]
            assert len(list(Path(tmp, "kernels").glob("*.cubin"))) == 1
            np.testing.assert_array_equal(results[0], results[1])
            np.testing.assert_array_equal(results[0], to_host(logits).argmax(axis=1))
        finally:
            cuda_modules._make_kernel_cache = real
            os.environ.clear()
            os.environ.update(saved[0])
            cuda_modules._modules.clear()
            cuda_modules._modules.update(saved[1])
            cuda_modules._functions.clear()
            cuda_modules._functions.update(saved[2])


# ---------------------------------------------------------------------------------------------
# Elementwise and normalisation ops
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("hidden", [64, 576, 4096, 5000])
def test_add_rms_norm(hidden, dtype):
    gpu_helpers.check_add_rms_norm(hidden, dtype)


@pytest.mark.gpu
def test_apply_rotary():
    gpu_helpers.check_apply_rotary()


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
    gpu_helpers.check_silu_and_mul(dtype)


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
    gpu_helpers.check_argmax_rows(dtype)


@pytest.mark.gpu
def test_ops_write_into_out():
    gpu_helpers.check_ops_write_into_out()


@pytest.mark.gpu
def test_ops_return_device_arrays():
    gpu_helpers.check_ops_return_device_arrays()


# ---------------------------------------------------------------------------------------------
# Whole models: GPU (float16) vs the numpy model (float32)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-llama32", "tiny-gemma3",
                                  "random-smollm2", "tiny-llama32-bias"])
def test_model_logits_match_numpy(name):
    gpu_helpers.check_model_logits_match_numpy(name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-llama32", "tiny-gemma3"])
def test_tiny_model_prompt_top1_matches_transformers_goldens(name):
    """Independent check: top-1 of the GPU logits against Hugging Face's (committed goldens), on every
    position where the golden top-1/top-2 gap is clear (> 0.05)."""
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.batch import SeqChunk, build_forward_batch
    from pagedserve.models.kv_cache import allocate_kv_caches

    _, gpu = model_pair(name)
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
