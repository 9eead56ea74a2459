"""The model registry: names resolve, unknown architectures are refused by name, and the one shape table
gives the sizes and FLOPs the hand-written formulas used to."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from pagedserve.models import registry
from pagedserve.models.config import ModelConfig, config_from_hf_dict, load_hf_config
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.loading.gguf_loader import load_gguf_weights
from pagedserve.models.loading.loader import load_model
from pagedserve.models.tensor_parallel import TPShard
from pagedserve.runtime.worker.memory_budget import weights_bytes

from model_factory import random_model, write_gguf

SMOLLM2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 1e4, 8192, tie_word_embeddings=True)
LLAMA3_8B = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 5e5, 8192)
QWEN2_05B = ModelConfig("qwen2", 151936, 896, 4864, 24, 14, 2, 64, 1e-6, 1e6, 32768, tie_word_embeddings=True,
                        attention_bias=True)

HF_BASE = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1}


def old_weights_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """memory_budget.weights_bytes before the registry (it left q/k/v biases out)."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return (embed + cfg.num_hidden_layers * per_layer + h) * itemsize


def old_matmul_flops(cfg: ModelConfig) -> int:
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    return cfg.num_hidden_layers * (2 * h * (q + 2 * kv) + 2 * q * h + 6 * h * cfg.intermediate_size)


@pytest.mark.parametrize("entry", list(registry.supported().values()), ids=lambda e: e.name)
def test_every_entry_resolves_from_its_names(entry):
    for hf in entry.hf_names:
        assert registry.lookup_hf(hf) is entry
        assert config_from_hf_dict({**HF_BASE, "architectures": [hf]}).architecture == entry.name
    if entry.gguf_name is not None:
        assert registry.lookup_gguf(entry.gguf_name) is entry
    else:  # llama.cpp writes Mistral checkpoints as "llama": the same block, the same q/k permutation
        same = registry.lookup_gguf("llama")
        assert (same.layer_shapes, same.gguf_layer_names, same.gguf_qk_permuted) == (
            entry.layer_shapes, entry.gguf_layer_names, entry.gguf_qk_permuted)
    cfg = dataclasses.replace(SMOLLM2, architecture=entry.name)
    assert registry.for_config(cfg) is entry
    assert issubclass(entry.model_class, LlamaForCausalLM)  # the families beyond the Llama block override steps


def test_registry_flags():
    assert registry.lookup_hf("Qwen2ForCausalLM").qkv_bias and not registry.lookup_hf("LlamaForCausalLM").qkv_bias
    assert config_from_hf_dict({**HF_BASE, "architectures": ["Qwen2ForCausalLM"]}).attention_bias
    assert not config_from_hf_dict({**HF_BASE, "architectures": ["MistralForCausalLM"]}).attention_bias
    assert registry.lookup_gguf("llama").gguf_qk_permuted and not registry.lookup_gguf("qwen2").gguf_qk_permuted


SUPPORTED_HF = (r"\['Gemma3ForCausalLM', 'LlamaForCausalLM', 'MistralForCausalLM', 'Phi3ForCausalLM', "
                r"'Qwen2ForCausalLM', 'Qwen3ForCausalLM'\]")


def test_unknown_hf_architecture_is_named_with_the_supported_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]; supported: " + SUPPORTED_HF):
        config_from_hf_dict({**HF_BASE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'; supported: \['Gemma3"):
        registry.lookup_hf("GPT2LMHeadModel")
    (tmp_path / "config.json").write_text(json.dumps({**HF_BASE, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"config.json: unsupported architecture.*GPT2LMHeadModel.*supported"):
        load_hf_config(tmp_path)
    with pytest.raises(ValueError, match=r"unsupported architecture.*GPT2LMHeadModel.*Qwen3ForCausalLM"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match=r"unsupported model architecture 'gpt2'; supported: \['gemma3', 'llama'"):
        registry.for_config(dataclasses.replace(SMOLLM2, architecture="gpt2"))


def test_unknown_gguf_architecture_is_named_with_the_supported_ones(tmp_path):
    cfg, w = random_model("llama", seed=3, layers=1)
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, cfg, w, arch="gpt2")
    supported = r"supported: \['gemma3', 'llama', 'phi3', 'qwen2', 'qwen3'\]"
    with pytest.raises(ValueError, match=r"gpt2.gguf: unsupported GGUF architecture 'gpt2'; " + supported):
        load_gguf_weights(path)
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'; " + supported):
        load_model(path, use_cache=False)


@pytest.mark.parametrize("cfg", [SMOLLM2, LLAMA3_8B, QWEN2_05B], ids=["smollm2", "llama3-8b", "qwen2-0.5b"])
def test_shape_table_gives_the_old_bytes_and_flops(cfg):
    assert cfg.matmul_flops_per_token == registry.matmul_flops_per_token(cfg) == old_matmul_flops(cfg)
    bias = cfg.num_hidden_layers * (cfg.q_size + 2 * cfg.kv_size) if cfg.attention_bias else 0
    for itemsize in (2, 4):
        # The old host formula left the q/k/v biases out; the shape table counts them.
        assert weights_bytes(cfg, itemsize) == registry.weight_bytes(cfg, itemsize) \
            == old_weights_bytes(cfg, itemsize) + bias * itemsize
    shapes = registry.expected_shapes(cfg)
    assert registry.weight_bytes(cfg, 2) == 2 * sum(int(np.prod(s)) for s in shapes.values())
    assert ("lm_head.weight" in shapes) == (not cfg.tie_word_embeddings)


def test_known_values():
    assert SMOLLM2.matmul_flops_per_token == 212_336_640
    assert SMOLLM2.matmul_flops_per_token / SMOLLM2.attention_flops_per_key == 3072.0
    assert LLAMA3_8B.matmul_flops_per_token / LLAMA3_8B.attention_flops_per_key == 26624.0
    assert registry.weight_bytes(LLAMA3_8B, 2) == 16_060_522_496  # Llama-3-8B's 8.03 B parameters in bf16


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weight_bytes_are_the_arrays_bytes_whole_and_per_rank(arch):
    cfg, weights = random_model(arch, heads=4, kv_heads=2)
    assert registry.weight_bytes(cfg, 4) == sum(w.nbytes for w in weights.values())
    registry.check_weights(cfg, weights, "w")
    ranks = [TPShard(r, 2) for r in range(2)]
    per_rank = [registry.weight_bytes(cfg, 4, s) for s in ranks]
    norms = sum(int(np.prod(s)) for n, s in registry.expected_shapes(cfg).items() if n.endswith("norm.weight"))
    assert sum(per_rank) == registry.weight_bytes(cfg, 4) + 4 * norms  # norms are replicated, the rest split


def _write_qwen2_gguf(path, cfg: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    """A Qwen2 GGUF as llama.cpp writes one: q/k rows as in the checkpoint (NeoX rope), q/k/v biases."""
    import gguf

    to_gguf = {hf: gg for gg, hf in registry.QWEN2.gguf_layer_names.items()}
    globals_ = {hf: gg for gg, hf in registry.QWEN2.gguf_global_names.items()}
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for name, t in weights.items():
        if name in globals_:
            gname = globals_[name]
        else:
            layer, rest = name.split(".")[2], name.split(".", 3)[3]
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{to_gguf[module]}.{kind}"
        w.add_tensor(gname, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen2_gguf_loads_through_its_entry(tmp_path):
    cfg, weights = random_model("qwen2", seed=5, layers=2)
    path = tmp_path / "qwen2.gguf"
    _write_qwen2_gguf(path, cfg, weights)
    gcfg, gw = load_gguf_weights(path)
    assert gcfg.architecture == "qwen2" and gcfg.attention_bias and gcfg.tie_word_embeddings
    assert set(gw) == set(weights)
    for name, t in weights.items():  # no q/k un-permutation for Qwen2
        np.testing.assert_array_equal(gw[name], t, err_msg=name)
