"""The loaders refuse what they cannot run (issue 60, item 5): each tiny checkpoint below, given one config key
the model does not implement (and the tensors that key brings), loaded and ran wrongly before; now the load
fails with a ValueError naming the key, its value and the architecture. Tensors the model would not use are
refused in both formats, and tie_word_embeddings must agree with the checkpoint's lm_head.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from model_factory import edited_copy as tiny, random_biases, random_model, stored_weights as stored, write_gguf

from pagedserve.models.config import config_from_hf_dict
from pagedserve.models.loading.gguf_loader import load_gguf_weights
from pagedserve.models.loading.hf_loader import load_hf_weights
from pagedserve.models.loading.loader import load_model


def refused(key_value: str, arch: str):
    return pytest.raises(ValueError, match=rf"\({arch}\): .*{re.escape(key_value)} is not supported")


QKVO = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize("name, arch", [("tiny-qwen3", "Qwen3ForCausalLM"), ("tiny-gemma3", "Gemma3ForCausalLM")])
def test_attention_bias_with_its_tensors_is_refused(data_dir, tmp_path, name, arch):
    """q/k/v and o_proj biases: before, q/k/v were loaded and o_proj's ignored (Llama's now run: below)."""
    d = tiny(data_dir, tmp_path, name, {"attention_bias": True}, random_biases(data_dir, name, QKVO))
    with refused("attention_bias=True", arch):
        load_model(d)


def test_llama_mlp_bias_is_refused(data_dir, tmp_path):
    d = tiny(data_dir, tmp_path, "tiny-llama32", {"mlp_bias": True}, random_biases(data_dir, "tiny-llama32", MLP))
    with refused("mlp_bias=True", "LlamaForCausalLM"):
        load_model(d)


@pytest.mark.parametrize("name, edit, key_value, arch", [
    ("tiny-llama32", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5", "LlamaForCausalLM"),
    ("tiny-qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
     "rope_parameters.partial_rotary_factor=0.25", "Qwen3ForCausalLM"),
    ("tiny-llama", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh'", "LlamaForCausalLM"),
    ("tiny-qwen2", {"hidden_act": "gelu"}, "hidden_act='gelu'", "Qwen2ForCausalLM"),
    ("tiny-gemma3", {"hidden_activation": "silu"}, "hidden_activation='silu'", "Gemma3ForCausalLM"),
    ("tiny-qwen3", {"quantization_config": {"quant_method": "gptq", "bits": 4}},
     "quantization_config={'quant_method': 'gptq'}", "Qwen3ForCausalLM"),
    ("tiny-gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0", "Gemma3ForCausalLM"),
    ("tiny-qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "rope_parameters.rope_type='yarn'", "Qwen3ForCausalLM"),
    ("tiny-llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.type='dynamic'",
     "LlamaForCausalLM"),
])
def test_a_config_key_the_model_does_not_implement_is_refused(data_dir, tmp_path, name, edit, key_value, arch):
    d = tiny(data_dir, tmp_path, name, edit)
    with refused(key_value, arch):
        load_model(d)


def test_tied_config_with_a_different_lm_head_is_refused(data_dir, tmp_path):
    embed = stored(data_dir, "tiny-llama32")["model.embed_tokens.weight"]
    d = tiny(data_dir, tmp_path, "tiny-llama32", tensors={"lm_head.weight": embed[::-1]})
    with pytest.raises(ValueError, match="tie_word_embeddings=True, but the checkpoint's lm_head.weight is not"):
        load_model(d)
    same = tiny(data_dir, tmp_path / "same", "tiny-llama32", tensors={"lm_head.weight": embed})
    cfg, weights = load_hf_weights(same)  # a tied checkpoint that stores the embedding twice is fine
    assert cfg.tie_word_embeddings and "lm_head.weight" not in weights


def test_untied_config_without_lm_head_is_refused(data_dir, tmp_path):
    d = tiny(data_dir, tmp_path, "tiny-qwen3", {"tie_word_embeddings": False})
    with pytest.raises(ValueError, match=r"tie_word_embeddings=False .* has no lm_head.weight"):
        load_model(d)


def test_an_extra_tensor_in_a_safetensors_file_is_refused(data_dir, tmp_path):
    """Sharded (an index names the extra file) and single-file checkpoints alike; up to three names are given."""
    extra = {f"model.layers.0.mlp.extra_{i}.weight": np.ones(4) for i in range(5)}
    for name in ("tiny-llama", "tiny-qwen2"):
        d = tiny(data_dir, tmp_path, name, tensors=extra)
        with pytest.raises(ValueError, match=r"5 tensor\(s\) this .* config does not use: "
                                             r"'model.layers.0.mlp.extra_0.weight', .* and 2 more"):
            load_model(d)


def test_rotary_inv_freq_buffers_are_ignored_as_transformers_does(data_dir, tmp_path):
    d = tiny(data_dir, tmp_path, "tiny-llama32", tensors={"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(32)})
    _, weights = load_hf_weights(d)
    assert not any("rotary_emb" in n for n in weights)


def test_qwen2_sliding_window_is_honoured_not_ignored():
    base = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": 32}
    cfg = config_from_hf_dict({**base, "use_sliding_window": True, "max_window_layers": 1})
    assert [cfg.layer_window(n) for n in range(2)] == [None, 32]
    assert config_from_hf_dict({**base, "use_sliding_window": False}).layer_types == ()


def test_mistral_and_phi3_ignore_attention_bias_as_transformers_does():
    """Their attention has no bias whatever the key says: no bias tensors are expected."""
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "attention_bias": True}
    for arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        assert not config_from_hf_dict({**base, "architectures": [arch]}).attention_bias


# -- GGUF: the same facts, where the metadata carries them ---------------------------------------


def test_gguf_tensor_the_config_does_not_use_is_refused(tmp_path):
    cfg, weights = random_model("llama", seed=3, layers=1)
    path = tmp_path / "bias.gguf"
    write_gguf(path, cfg, weights, extra_tensors={"blk.0.ffn_down.bias": np.ones(cfg.hidden_size)})
    with pytest.raises(ValueError, match=r"config does not use: 'model.layers.0.mlp.down_proj.bias'"):
        load_gguf_weights(path)


def test_gguf_partial_rotary_and_unknown_rope_scaling_are_refused(tmp_path):
    import gguf

    cfg, weights = random_model("llama", seed=3, layers=1)
    path = tmp_path / "partial.gguf"
    write_gguf(path, cfg, weights, rope_dims=cfg.head_dim // 2)
    with pytest.raises(ValueError, match=r"llama.rope.dimension_count=8 is not supported"):
        load_gguf_weights(path)
    yarn = tmp_path / "yarn.gguf"
    write_gguf(yarn, cfg, weights, extra_meta=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN))
    with pytest.raises(ValueError, match=r"llama.rope.scaling.type='yarn' is not supported"):
        load_gguf_weights(yarn)


def test_gguf_linear_rope_scaling_is_honoured(tmp_path):
    import gguf

    cfg, weights = random_model("llama", seed=3, layers=1)
    path = tmp_path / "linear.gguf"

    def meta(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    write_gguf(path, cfg, weights, extra_meta=meta)
    gcfg, _ = load_gguf_weights(path)
    assert gcfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}


# -- Llama's attention_bias is implemented: q/k/v bias (Qwen2's path) and an o_proj bias -------------


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def reference_logits(cfg, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """A plain float64 Llama forward over one sequence (no paging, no fusing), every bias the weights hold
    added where transformers' LlamaAttention adds it; rotary frequencies from rope.py (goldens check them)."""
    from pagedserve.models.rope import rope_inv_freq

    w = {k: v.astype(np.float64) for k, v in w.items()}
    t, hd, heads, kv_heads = len(ids), cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    ang = np.outer(np.arange(t), rope_inv_freq(cfg))
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rotate(x):  # [t, heads, hd], rotate-half
        half = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * cos[:, None] + half * sin[:, None]

    x = w["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."

        def proj(name, h):
            return h @ w[p + name + ".weight"].T + w.get(p + name + ".bias", 0.0)

        h = _rms(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = rotate(proj("self_attn.q_proj", h).reshape(t, heads, hd))
        k = np.repeat(rotate(proj("self_attn.k_proj", h).reshape(t, kv_heads, hd)), heads // kv_heads, axis=1)
        v = np.repeat(proj("self_attn.v_proj", h).reshape(t, kv_heads, hd), heads // kv_heads, axis=1)
        s = np.einsum("thd,shd->hts", q, k) * hd ** -0.5 + mask
        prob = np.exp(s - s.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        x = x + proj("self_attn.o_proj", np.einsum("hts,shd->thd", prob, v).reshape(t, heads * hd))
        h = _rms(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate = proj("mlp.gate_proj", h)
        x = x + proj("mlp.down_proj", gate / (1 + np.exp(-gate)) * proj("mlp.up_proj", h))
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    return _rms(x, w["model.norm.weight"], cfg.rms_norm_eps) @ head.T


def _model_logits(cfg, weights, ids, kernels: str) -> np.ndarray:
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.batch import SeqChunk, build_forward_batch
    from pagedserve.models.kv_cache import allocate_kv_caches
    from pagedserve.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(cfg, weights, get_backend("cpu", kernels))
    kv = allocate_kv_caches(cfg, 16, 16, model.backend)
    batch = build_forward_batch([SeqChunk(ids, 0, list(range(-(-len(ids) // 16))), num_logits=len(ids))], 16)
    return np.asarray(model.forward(batch, kv), dtype=np.float64)


def test_the_reference_forward_is_transformers_on_tiny_llama32(data_dir):
    """The hand-written reference below is itself checked against transformers' logits (the goldens)."""
    golden = np.load(data_dir / "goldens" / "tiny-llama32.npz")
    cfg, weights = load_hf_weights(data_dir / "tiny-llama32")
    ids = [int(i) for i in golden["prompt_ids_2"]]
    ref = reference_logits(cfg, weights, ids)
    top = golden["topk_ids_2"]
    np.testing.assert_allclose(ref[np.arange(len(ids))[:, None], top], golden["topk_logits_2"], atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_llama_attention_bias_runs_q_k_v_and_o_proj_random_biases(data_dir, tmp_path, kernels):
    golden = np.load(data_dir / "goldens" / "tiny-llama32.npz")
    ids = [int(i) for i in golden["prompt_ids_2"]]
    d = tiny(data_dir, tmp_path, "tiny-llama32", {"attention_bias": True},
             random_biases(data_dir, "tiny-llama32", QKVO))
    cfg, weights = load_hf_weights(d)
    assert cfg.attention_bias and cfg.o_proj_bias and "model.layers.1.self_attn.o_proj.bias" in weights
    ref = reference_logits(cfg, weights, ids)
    got = _model_logits(cfg, weights, ids, kernels)
    np.testing.assert_allclose(got, ref, atol=2e-3, rtol=1e-4)
    # the o_proj bias matters: without it the logits are far from these
    no_o = {k: v for k, v in weights.items() if not k.endswith("o_proj.bias")}
    assert np.abs(reference_logits(cfg, no_o, ids) - ref).max() > 0.5


def test_llama_gguf_with_an_o_proj_bias_loads_it(tmp_path):
    cfg, weights = random_model("llama", seed=3, layers=1)
    path = tmp_path / "bias.gguf"
    write_gguf(path, cfg, weights, extra_tensors={"blk.0.attn_output.bias": np.arange(cfg.hidden_size)})
    gcfg, gw = load_gguf_weights(path)
    assert gcfg.o_proj_bias and not gcfg.attention_bias
    np.testing.assert_array_equal(gw["model.layers.0.self_attn.o_proj.bias"], np.arange(cfg.hidden_size))
