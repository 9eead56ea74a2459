"""PEFT adapter directories: read and checked against the base model (models/loading/peft.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lora_helpers import DATA, make_lora
from pagedserve.models.config import load_hf_config
from pagedserve.models.loading.peft import TARGET_MODULES, load_peft_adapter


@pytest.fixture(scope="module")
def config():
    return load_hf_config(DATA / "tiny-llama")


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def test_reads_every_module_and_scale(tmp_path, config):
    path = make_lora(tmp_path / "a", config, rank=8, alpha=16)
    a = load_peft_adapter(path, config)
    assert a.rank == 8 and a.scale == 2.0 and a.target_modules == TARGET_MODULES
    assert len(a.weights) == config.num_hidden_layers * 7
    A, B = a.weights[(0, "k_proj")]
    assert A.shape == (8, config.hidden_size) and B.shape == (config.num_key_value_heads * config.head_dim, 8)
    raw = load_file(str(path / "adapter_model.safetensors"))
    np.testing.assert_array_equal(B, raw["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"])


def test_rslora_scale(tmp_path, config):
    a = load_peft_adapter(make_lora(tmp_path / "a", config, rank=16, alpha=8, rslora=True,
                                    targets=("q_proj", "v_proj")), config)
    assert a.scale == pytest.approx(8 / math.sqrt(16))
    assert a.target_modules == ("q_proj", "v_proj")


@pytest.mark.parametrize("change, words", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"r": 0}, "r must be"),
    ({"peft_type": "IA3"}, "IA3"),
])
def test_refused_config(tmp_path, config, change, words):
    path = make_lora(tmp_path / "a", config, rank=4)
    _edit_config(path, **change)
    with pytest.raises(ValueError, match=words):
        load_peft_adapter(path, config)


def test_rank_above_max(tmp_path, config):
    with pytest.raises(ValueError, match="max_lora_rank=8"):
        load_peft_adapter(make_lora(tmp_path / "a", config, rank=16), config, max_lora_rank=8)


def test_shape_mismatch(tmp_path, config):
    path = make_lora(tmp_path / "a", config, rank=4)
    raw = load_file(str(path / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    raw[key] = np.zeros((raw[key].shape[0] + 1, 4), dtype=np.float32)
    save_file(raw, str(path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="layer 1 down_proj"):
        load_peft_adapter(path, config)


def test_module_the_model_lacks(tmp_path, config):
    path = make_lora(tmp_path / "a", config, rank=4, targets=("q_proj",))
    raw = load_file(str(path / "adapter_model.safetensors"))
    raw["base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight"] = np.zeros((4, 8), np.float32)
    save_file(raw, str(path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="qkv_proj"):
        load_peft_adapter(path, config)


def test_layer_the_model_lacks(tmp_path, config):
    path = make_lora(tmp_path / "a", config, rank=4, targets=("q_proj",))
    raw = load_file(str(path / "adapter_model.safetensors"))
    raw[f"base_model.model.model.layers.{config.num_hidden_layers}.self_attn.q_proj.lora_A.weight"] = \
        raw["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    save_file(raw, str(path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=f"names layer {config.num_hidden_layers}"):
        load_peft_adapter(path, config)


def test_missing_and_corrupt_files(tmp_path, config):
    with pytest.raises(ValueError, match="directory not found"):
        load_peft_adapter(tmp_path / "nowhere", config)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        load_peft_adapter(tmp_path / "file", config)
    path = make_lora(tmp_path / "a", config, rank=4)
    (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        load_peft_adapter(path, config)
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="adapter_model.safetensors not found"):
        load_peft_adapter(path, config)
    (path / "adapter_config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_peft_adapter(path, config)
    (path / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="adapter_config.json not found"):
        load_peft_adapter(path, config)
