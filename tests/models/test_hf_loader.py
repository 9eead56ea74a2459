"""Hugging Face directories: config parsing, sharded/bf16 safetensors, and precise errors on bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from pagedserve.models.config import config_from_hf_dict
from pagedserve.models.loading.hf_loader import load_hf_weights
from pagedserve.models.loading.loader import load_model
from pagedserve.models.loading.safetensors_io import read_safetensors

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2}


def copy_model(data_dir, tmp_path, name="tiny-llama"):
    dst = tmp_path / name
    shutil.copytree(data_dir / name, dst)
    return dst


def test_sharded_bf16_checkpoint_loads_as_float32(data_dir):
    cfg, w = load_hf_weights(data_dir / "tiny-llama")
    assert cfg.architecture == "llama" and not cfg.tie_word_embeddings
    assert cfg.rope_scaling["rope_type"] == "llama3"
    assert "lm_head.weight" in w and all(t.dtype == np.float32 for t in w.values())
    # bf16 widened exactly: the low 16 bits of every float32 are zero.
    assert not (w["model.embed_tokens.weight"].view(np.uint32) & 0xFFFF).any()


def test_qwen2_has_bias_and_tied_embeddings(data_dir):
    cfg, w = load_hf_weights(data_dir / "tiny-qwen2")
    assert cfg.architecture == "qwen2" and cfg.attention_bias and cfg.tie_word_embeddings
    assert "model.layers.0.self_attn.q_proj.bias" in w


def test_rope_theta_top_level_or_rope_parameters():
    assert config_from_hf_dict({**BASE, "rope_theta": 123.0}).rope_theta == 123.0
    cfg = config_from_hf_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 77.0}})
    assert cfg.rope_theta == 77.0 and cfg.rope_scaling is None
    mistral = config_from_hf_dict({**BASE, "architectures": ["MistralForCausalLM"], "num_key_value_heads": 1})
    assert mistral.architecture == "mistral" and mistral.num_key_value_heads == 1 and mistral.head_dim == 4


def test_unsupported_architecture_and_rope_type(tmp_path):
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        config_from_hf_dict({**BASE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        config_from_hf_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 2}})
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        config_from_hf_dict({k: v for k, v in BASE.items() if k != "hidden_size"})


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_model(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty/config.json: not found"):
        load_model(tmp_path / "empty")


def test_shape_mismatch_names_the_tensor(data_dir, tmp_path):
    d = copy_model(data_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 300
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"tiny-llama: tensor 'model.layers.0.mlp.gate_proj.weight' has shape \(256, 128\), expected \(300, 128\)"):  # noqa: E501
        load_model(d)


def test_corrupt_safetensors_names_the_file(data_dir, tmp_path):
    d = copy_model(data_dir, tmp_path)
    shard = d / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        load_model(d)
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="index.json: corrupt shard index"):
        load_model(d)


def test_missing_tensor_names_it(tmp_path):
    from safetensors.numpy import save_file

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(BASE))
    save_file({"model.embed_tokens.weight": np.zeros((10, 8), np.float32)}, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor 'model.norm.weight'"):
        load_model(d)
    assert read_safetensors(d / "model.safetensors")["model.embed_tokens.weight"].shape == (10, 8)


def test_tokenizer_and_chat_template_come_with_the_model(data_dir):
    for name in ("tiny-llama", "tiny-qwen2"):  # template in tokenizer_config.json / chat_template.jinja
        loaded = load_model(data_dir / name)
        text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        assert "hi" in text and loaded.tokenizer.eos_token_ids
