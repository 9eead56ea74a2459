"""The LoRA hook at the linear layers (models/lora.py): an adapter's rows equal the forward of the model with the
adapter merged into its weights (W + scale B A, the exact math), base rows in the same batch equal the base model."""

from __future__ import annotations

import numpy as np
import pytest

from lora_helpers import DATA, make_lora
from numerics import model_tol
from pagedserve.cupy_kernels.backend import get_backend
from pagedserve.models import lora as model_lora, registry
from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.kv_cache import allocate_kv_caches
from pagedserve.models.loading.loader import load_model
from pagedserve.models.loading.peft import load_peft_adapter


def merged(weights, adapter):
    """The checkpoint's weights with the adapter folded in: W + scale * B @ A on every targeted projection."""
    out = dict(weights)
    for (n, module), (a, b) in adapter.weights.items():
        block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        name = f"model.layers.{n}.{block}.{module}.weight"
        out[name] = (weights[name].astype(np.float64) + adapter.scale * (b.astype(np.float64) @ a)).astype(np.float32)
    return out


def forward(model, cfg, chunks, backend):
    kv = allocate_kv_caches(cfg, 16, 16, backend)
    return model.forward(build_forward_batch(chunks, 16), kv)


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3", "tiny-gemma3"])
def test_adapter_rows_equal_merged_weights_and_base_rows_the_base(tmp_path, kernels, family):
    loaded = load_model(DATA / family)
    cfg, weights = loaded.config, loaded.weights
    backend = get_backend("cpu", kernels)
    cls = registry.for_config(cfg).model_class
    a1 = load_peft_adapter(make_lora(tmp_path / "a1", cfg, rank=8, alpha=16, seed=1, std=0.1), cfg)
    a2 = load_peft_adapter(make_lora(tmp_path / "a2", cfg, rank=4, alpha=8, rslora=True, seed=2, std=0.1,
                                     targets=("q_proj", "v_proj")), cfg)
    model = cls(cfg, weights, backend)
    model_lora.attach(model, weights, max_loras=3, max_lora_rank=8)
    model.lora.set(0, a2)
    model.lora.set(2, a1)
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(11)]
    chunks = [SeqChunk(prompt, 0, [0], lora_slot=2), SeqChunk(prompt, 0, [1]), SeqChunk(prompt, 0, [2], lora_slot=0)]
    got = forward(model, cfg, chunks, backend)
    for k, w in enumerate([merged(weights, a1), weights, merged(weights, a2)]):
        want = forward(cls(cfg, w, backend), cfg, [SeqChunk(prompt, 0, [0])], backend)[0]
        np.testing.assert_allclose(got[k], want, atol=model_tol(cfg, np.abs(want).max()), rtol=0)
    # The adapters change the logits by far more than the tolerance (the test can fail).
    assert np.abs(got[0] - got[1]).max() > 100 * model_tol(cfg, np.abs(got[1]).max())
    assert np.abs(got[2] - got[1]).max() > 100 * model_tol(cfg, np.abs(got[1]).max())


def test_refused_where_adapters_cannot_be_served():
    """A family whose blocks do not thread the LoRA hook (its own _mlp here) is refused by name, not served wrong."""
    loaded = load_model(DATA / "tiny-llama")

    class OwnMLP(registry.for_config(loaded.config).model_class):
        def _mlp(self, layer, x, add_to=None, lora=None, rows=None):
            return super()._mlp(layer, x, add_to)

    model = OwnMLP(loaded.config, loaded.weights, get_backend("cpu", "numpy"))
    with pytest.raises(ValueError, match="llama models are not served with adapters"):
        model_lora.attach(model, loaded.weights, 2, 8)


def test_base_only_steps_keep_the_fused_mlp_and_call_no_lora_code(tmp_path):
    """enable_lora costs a base-only step nothing (numba set): gate_up stays packed for the fused SiLU, the step
    calls linear_silu_and_mul and no LoRA op, and its logits are the plain model's bit for bit. A step with an
    adapter row multiplies the same gated panels plainly and adds the deltas (the LoRA ops are called)."""
    import dataclasses

    loaded = load_model(DATA / "tiny-llama")
    cfg, weights = loaded.config, loaded.weights
    backend = get_backend("cpu", "numba")
    cls = registry.for_config(cfg).model_class
    model = cls(cfg, weights, backend)
    model_lora.attach(model, weights, max_loras=2, max_lora_rank=8)
    model.lora.set(1, load_peft_adapter(make_lora(tmp_path / "a", cfg, rank=8, seed=3, std=0.1), cfg))
    assert all(layer.gate_up.gated for layer in model.layers)  # (the forward test covers the adapter rows' math)
    calls = {"lora": 0, "fused": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    ops = backend.ops
    counted = dataclasses.replace(ops, lora_shrink=counting("lora", ops.lora_shrink),
                                  linear_silu_and_mul=counting("fused", ops.linear_silu_and_mul))
    object.__setattr__(model, "backend", dataclasses.replace(backend, ops=counted))
    prompt = [(5 * i + 1) % cfg.vocab_size for i in range(9)]
    got = forward(model, cfg, [SeqChunk(prompt, 0, [0]), SeqChunk(prompt[:4], 0, [1])], backend)
    assert calls == {"lora": 0, "fused": cfg.num_hidden_layers}
    plain = forward(cls(cfg, weights, backend), cfg, [SeqChunk(prompt, 0, [0]), SeqChunk(prompt[:4], 0, [1])],
                    backend)
    np.testing.assert_array_equal(got, plain)
    forward(model, cfg, [SeqChunk(prompt, 0, [0], lora_slot=1), SeqChunk(prompt[:4], 0, [1])], backend)
    assert calls["lora"] == 4 * cfg.num_hidden_layers and calls["fused"] == cfg.num_hidden_layers
