"""Debug mode: inf/NaN in the residual stream stops the forward with the layer and rows named."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.models.activation_check import NonFiniteActivationError, enabled_by_env
from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.kv_cache import allocate_kv_caches
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.worker.cuda_graphs import build_decode_graphs

from model_factory import random_model


def _poisoned(monkeypatch, check: bool):
    monkeypatch.setenv("PAGEDSERVE_CHECK_ACTIVATIONS", "1" if check else "0")
    cfg, weights = random_model(layers=3, vocab=50)
    weights["model.layers.1.mlp.down_proj.weight"][:, :] = 3e38  # layer 1 MLP output overflows float32
    model = LlamaForCausalLM(cfg, weights)
    kv = allocate_kv_caches(cfg, 8, 16, model.backend)
    batch = build_forward_batch([SeqChunk([1, 2, 3], 0, [0]), SeqChunk([4, 7, 5], 0, [1])], 16)
    return model, kv, batch


def test_without_the_check_an_overflow_passes_silently(monkeypatch):
    model, kv, batch = _poisoned(monkeypatch, check=False)
    assert not model.check_activations
    with np.errstate(all="ignore"):
        logits = model.forward(batch, kv)
    assert not np.isfinite(logits).any()  # garbage reaches the sampler, no error


def test_the_check_names_the_layer_checkpoint_and_rows(monkeypatch):
    model, kv, batch = _poisoned(monkeypatch, check=True)
    assert model.check_activations
    with np.errstate(all="ignore"), pytest.raises(NonFiniteActivationError) as err:
        model.forward(batch, kv)
    message = str(err.value)
    assert message.startswith("layer 2 input: ") and "6 token row(s), first [0, 1, 2, 3, 4, 5]" in message
    assert "largest finite |residual| before it" in message


def test_clean_forwards_record_the_peak_per_checkpoint(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CHECK_ACTIVATIONS", "1")
    cfg, weights = random_model(layers=2, vocab=50)
    model = LlamaForCausalLM(cfg, weights)
    kv = allocate_kv_caches(cfg, 8, 16, model.backend)
    batch = build_forward_batch([SeqChunk([1, 2, 3], 0, [0])], 16)
    plain = LlamaForCausalLM(cfg, weights)
    plain.check_activations = False
    np.testing.assert_array_equal(model.forward(batch, kv), plain.forward(batch, allocate_kv_caches(cfg, 8, 16, plain.backend)))  # noqa: E501
    assert list(model.activation_peaks) == ["layer 0 input", "layer 0 after attention", "layer 1 input",
                                            "layer 1 after attention", "final norm input"]
    assert all(0 < v < 1e4 for v in model.activation_peaks.values())


def test_env_switch_and_no_graphs_while_checking(monkeypatch):
    for value, on in (("1", True), ("0", False), ("", False), ("yes", True)):
        monkeypatch.setenv("PAGEDSERVE_CHECK_ACTIVATIONS", value)
        assert enabled_by_env() is on
    cfg, weights = random_model(layers=1, vocab=50)
    model = LlamaForCausalLM(cfg, weights)
    model.backend = type(model.backend)("cupy", np, np.dtype(np.float32))  # claims to be the GPU
    model.check_activations = True
    kv = allocate_kv_caches(cfg, 8, 16, model.backend)

    class Unused:
        def __getattr__(self, name):
            raise AssertionError("no capture while activation checks are on")

    assert build_decode_graphs(EngineConfig(max_num_seqs=2), model, kv, 64, Unused()) is None
