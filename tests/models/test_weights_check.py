"""The float16 range check of weights bound for the GPU (numpy arrays; no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.cupy_kernels.backend import Backend
from pagedserve.models.config import ModelConfig
from pagedserve.models.llama import LlamaForCausalLM, expected_shapes
from pagedserve.models.loading.weights_check import FLOAT16_MAX, FLOAT16_OVERFLOW, check_float16_range, max_abs


def test_threshold_is_where_float32_rounds_to_inf_in_float16():
    below = np.nextafter(np.float32(FLOAT16_OVERFLOW), np.float32(0))
    assert np.isfinite(np.float16(below)) and np.float16(below) == FLOAT16_MAX
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(np.float32(FLOAT16_OVERFLOW)))


@pytest.mark.parametrize("value", [0.0, 1.5, -FLOAT16_MAX, FLOAT16_MAX, 65519.0, -65519.0])
def test_values_that_fit_pass(value):
    check_float16_range({"w": np.array([[0.25, value]], dtype=np.float32)}, "model.safetensors")


@pytest.mark.parametrize("value", [FLOAT16_OVERFLOW, -70000.0, 1e30, np.inf, -np.inf])
def test_values_that_overflow_name_the_tensor_value_and_file(value):
    weights = {"ok": np.ones(4, np.float32),
               "model.layers.3.mlp.down_proj.weight": np.array([[1.0, value], [2.0, 3.0]], dtype=np.float32)}
    with pytest.raises(ValueError) as e:
        check_float16_range(weights, "/models/x/model-00002-of-00002.safetensors")
    msg = str(e.value)
    assert "/models/x/model-00002-of-00002.safetensors" in msg
    assert "'model.layers.3.mlp.down_proj.weight'" in msg
    assert f"{abs(value):.6g}" in msg and "float16" in msg


def test_nan_is_an_error():
    with pytest.raises(ValueError, match="'w' contains NaN"):
        check_float16_range({"w": np.array([1.0, np.nan], np.float32)}, "f.gguf")


def test_float16_integer_and_empty_tensors_are_skipped_or_fine():
    check_float16_range({"h": np.array([np.inf], np.float16), "i": np.array([10**9], np.int64),
                         "e": np.zeros((0, 3), np.float32)}, "f")
    assert max_abs(np.zeros((0,), np.float32)) == 0.0


def test_float64_and_views_are_checked():
    big = np.full((3, 3), 1e6, dtype=np.float64)
    with pytest.raises(ValueError, match="'t'"):
        check_float16_range({"t": big.T[:, :2]}, "f")
    assert max_abs(np.array([-7.0, 3.0])) == 7.0


def _tiny_config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64)


def _weights(cfg: ModelConfig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in expected_shapes(cfg).items()}


def test_model_checks_only_when_the_backend_stores_float16():
    cfg = _tiny_config()
    weights = _weights(cfg)
    weights["model.layers.0.self_attn.o_proj.weight"][1, 2] = 1e5
    LlamaForCausalLM(cfg, weights, source="w.safetensors")  # float32 (CPU) holds it
    f16 = Backend("numpy", np, np.dtype(np.float16))
    with pytest.raises(ValueError, match=r"w\.safetensors: tensor 'model\.layers\.0\.self_attn\.o_proj\.weight' "
                                         r"has max \|value\| 100000"):
        LlamaForCausalLM(cfg, weights, f16, source="w.safetensors")
    weights["model.layers.0.self_attn.o_proj.weight"][1, 2] = 0.5
    model = LlamaForCausalLM(cfg, weights, f16, source="w.safetensors")
    assert model.layers[0].o_proj.dtype == np.float16
