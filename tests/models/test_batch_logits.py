"""build_forward_batch's logits rows: a count per sequence (0, 1, or 1 + k for a speculative verify)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.models.batch import SeqChunk, build_forward_batch


def test_logits_rows_per_sequence_are_a_count():
    chunks = [SeqChunk([1, 2, 3], 0, [0]), SeqChunk([7, 8, 9], 7, [1]), SeqChunk([4, 5], 4, [2], num_logits=0),
              SeqChunk([6], 3, [3], num_logits=1), SeqChunk([1, 2, 3, 4], 2, [4], num_logits=4)]
    batch = build_forward_batch(chunks, 16)
    np.testing.assert_array_equal(batch.query_start_loc, [0, 3, 6, 8, 9, 13])
    np.testing.assert_array_equal(batch.logits_indices, [2, 5, 8, 9, 10, 11, 12])
    assert batch.logits_indices.dtype == np.int64


@pytest.mark.parametrize("bad", [-1, 3])
def test_num_logits_outside_the_chunk_is_refused(bad):
    with pytest.raises(ValueError, match="num_logits"):
        build_forward_batch([SeqChunk([1, 2], 0, [0], num_logits=bad)], 16)


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
@pytest.mark.parametrize("family", ["llama", "tiny-qwen3", "tiny-gemma3"])
def test_the_last_layer_computes_only_the_rows_that_want_logits(family, kernels, data_dir, monkeypatch):
    """A prefill chunk's other rows feed later steps only through the KV cache: the last layer's o_proj (and
    what follows) runs on the logits rows alone, with the logits and the KV cache of the full computation."""
    from model_factory import random_model

    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models import llama, registry
    from pagedserve.models.kv_cache import allocate_kv_caches
    from pagedserve.models.loading.loader import load_model

    if family == "llama":
        cfg, weights = random_model("llama", seed=3, hidden=64, head_dim=16, heads=4, kv_heads=2)
    else:
        loaded = load_model(data_dir / family)
        cfg, weights = loaded.config, loaded.weights
    model = registry.for_config(cfg).model_class(cfg, weights, get_backend("cpu", kernels))
    o_proj_rows = []
    ops = model.backend.ops
    last_o_proj = model.layers[-1].o_proj

    def linear(x, w, *args, **kwargs):
        if w is last_o_proj:
            o_proj_rows.append(x.shape[0])
        return ops.linear(x, w, *args, **kwargs)

    def linear_add(x, w, *args, **kwargs):  # the numba set's o_proj, adding into the residual
        if w is last_o_proj:
            o_proj_rows.append(x.shape[0])
        return ops.linear_add(x, w, *args, **kwargs)

    from dataclasses import replace
    model.backend = replace(model.backend, ops=replace(ops, linear=linear,
                                                       linear_add=linear_add if ops.linear_add else None))
    chunks = [SeqChunk(list(range(1, 20)), 0, [0, 1]), SeqChunk([5, 6, 7], 0, [2]),
              SeqChunk(list(range(30, 42)), 0, [3], num_logits=0), SeqChunk([8, 9, 10, 11], 0, [4], num_logits=2)]
    batch = build_forward_batch(chunks, 16)
    results = {}
    for pruned in (True, False):
        if not pruned:
            monkeypatch.setattr(llama, "rows_wanting_logits", lambda batch: None)
            if family == "tiny-gemma3":
                from pagedserve.models import gemma3
                monkeypatch.setattr(gemma3, "rows_wanting_logits", lambda batch: None)
        kv = allocate_kv_caches(cfg, 8, 16, model.backend)
        o_proj_rows.clear()
        results[pruned] = (model.forward(batch, kv), [np.array(k) for pair in kv for k in pair])
        assert o_proj_rows == [4 if pruned else batch.num_tokens]
    (pruned_logits, pruned_kv), (full_logits, full_kv) = results[True], results[False]
    assert pruned_logits.shape == (4, cfg.vocab_size)
    for a, b in zip(pruned_kv, full_kv):
        np.testing.assert_array_equal(a, b)
    if kernels == "numba":  # each row's arithmetic is independent of the other rows
        np.testing.assert_array_equal(pruned_logits, full_logits)
    else:  # numpy's BLAS may pick another kernel for 4 rows than for 38
        np.testing.assert_allclose(pruned_logits, full_logits, rtol=1e-5, atol=1e-5 * np.abs(full_logits).max())


def _numba_model(family, data_dir, **llama_shape):
    """The numba set's model: a random Llama of `llama_shape`, or a packaged tiny checkpoint."""
    from model_factory import random_model

    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models import registry
    from pagedserve.models.loading.loader import load_model

    if family == "llama":
        cfg, weights = random_model("llama", **llama_shape)
    else:
        loaded = load_model(data_dir / family)
        cfg, weights = loaded.config, loaded.weights
    return registry.for_config(cfg).model_class(cfg, weights, get_backend("cpu", "numba"))


def _assert_same_steps(model, fused, plain):
    """A prefill and a decode step with each kernel table: the logits and KV caches bit for bit."""
    from dataclasses import replace

    from pagedserve.models.kv_cache import allocate_kv_caches

    prefill = build_forward_batch([SeqChunk(list(range(1, 40)), 0, [0, 1, 2]), SeqChunk([5, 6, 7], 0, [3])], 16)
    decode = build_forward_batch([SeqChunk([9], 39, [0, 1, 2]), SeqChunk([4], 3, [3])], 16)
    results = []
    for table in (fused, plain):
        model.backend = replace(model.backend, ops=table)
        kv = allocate_kv_caches(model.config, 8, 16, model.backend)
        logits = [model.forward(batch, kv) for batch in (prefill, decode)]
        results.append(logits + [np.array(k) for pair in kv for k in pair])
    assert len(results[0]) == len(results[1]) == 2 + 2 * model.config.num_hidden_layers
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("family", ["llama", "tiny-qwen3"])
def test_adding_in_the_gemm_gives_the_logits_and_cache_of_add_rms_norm(family, data_dir):
    """The numba set adds o_proj's and down's outputs into the residual in its GEMM (ops.linear_add), then only
    normalises: the logits and KV caches are those of linear + add_rms_norm, bit for bit (one rounding of the
    same sum), in a prefill and a decode step."""
    from dataclasses import replace

    # hidden 64: two whole AVX-512 panels, so the tiles add
    model = _numba_model(family, data_dir, seed=5, hidden=64, head_dim=16, heads=4, kv_heads=2)
    ops = model.backend.ops
    assert ops.linear_add is not None
    added = []

    def linear_add(x, w, residual, quant=None):
        added.append(x.shape[0])
        return ops.linear_add(x, w, residual, quant=quant)

    _assert_same_steps(model, replace(ops, linear_add=linear_add), replace(ops, linear_add=None))
    assert len(added) == 2 * 2 * model.config.num_hidden_layers  # o_proj and down, every layer, both steps


@pytest.mark.parametrize("family", ["llama", "tiny-qwen3"])
def test_rotating_in_the_gemm_gives_the_logits_and_cache_of_rotary_and_cache(family, data_dir, monkeypatch):
    """The numba set rotates q and k and writes the cache in the qkv GEMM's tiles (ops.linear_rotary_cache) where
    nothing comes between the projection and rotary (Llama: yes; Qwen3's q/k norms: no, it keeps linear +
    its _query): logits and KV caches of a prefill and a decode step are those of linear + rotary_and_cache."""
    from dataclasses import replace

    from pagedserve.cupy_kernels.numba_cpu import gemm_rotary

    # head_dim 64: two whole panels (AVX-512) or four (AVX2), so the tiles rotate
    model = _numba_model(family, data_dir, seed=6, hidden=128, head_dim=64, heads=2, kv_heads=1)
    ops = model.backend.ops
    assert ops.linear_rotary_cache is not None
    fused_calls = []
    kernel = gemm_rotary.matmul_rotary_cache

    def counted(*args, **kwargs):
        fused_calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(gemm_rotary, "matmul_rotary_cache", counted)
    _assert_same_steps(model, ops, replace(ops, linear_rotary_cache=None))
    expected_calls = [42, 2] if family == "llama" else []  # the prefill's 42 rows, then the decode's 2
    assert fused_calls == [rows for rows in expected_calls for _ in range(model.config.num_hidden_layers)]
