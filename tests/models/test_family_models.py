"""The families beyond the Llama block (Qwen3, Phi-3, Gemma 3, Llama 3.2): configs as the Hub spells them, load-time
reshaping, GGUF names, and the numba kernel set against the numpy reference on each family's tiny checkpoint.

Logits against transformers are test_goldens.py's (every family, chunked and not); this file checks the pieces
that make them right and the kernel sets that must agree with the reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from numerics import assert_close_model

from pagedserve.cupy_kernels.backend import get_backend
from pagedserve.models import registry
from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.config import config_from_hf_dict
from pagedserve.models.gemma3 import Gemma3ForCausalLM
from pagedserve.models.kv_cache import allocate_kv_caches
from pagedserve.models.layers import gelu_tanh_and_mul
from pagedserve.models.loading.gguf_loader import load_gguf_weights
from pagedserve.models.loading.hf_loader import load_hf_weights
from pagedserve.models.loading.loader import load_model
from pagedserve.models.loading.safetensors_io import read_safetensors
from pagedserve.models.qwen3 import Qwen3ForCausalLM
from pagedserve.models.rope import RotaryEmbedding, plain_inv_freq
from pagedserve.models.tensor_parallel import TPShard

BLOCK = 16
FAMILIES = ["tiny-qwen3", "tiny-phi3", "tiny-gemma3", "tiny-llama32"]
BASE = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1}


def _stored(data_dir, name):
    out = {}
    for f in sorted((data_dir / name).glob("*.safetensors")):
        out.update(read_safetensors(f))
    return out


# -- configs ---------------------------------------------------------------------------------------


def test_gemma3_config_in_both_spellings():
    """transformers 5's per-layer-type rope_parameters and the Hub's older rope_theta + rope_local_base_freq +
    sliding_window_pattern give the same config."""
    new = config_from_hf_dict({**BASE, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 7,
                               "sliding_window": 512, "query_pre_attn_scalar": 256,
                               "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
                               "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    old = config_from_hf_dict({**BASE, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 7,
                               "sliding_window": 512, "query_pre_attn_scalar": 256, "rope_theta": 1e6,
                               "rope_local_base_freq": 1e4, "sliding_window_pattern": 6})
    assert new == old
    assert new.head_dim == 256 and new.tie_word_embeddings and new.hidden_act == "gelu_pytorch_tanh"
    assert [new.layer_window(n) for n in range(7)] == [512] * 5 + [None, 512]
    assert (new.rope_theta, new.rope_local_theta, new.query_pre_attn_scalar) == (1e6, 1e4, 256.0)


def test_gemma3_4b_linear_rope_on_the_global_layers_only():
    cfg = config_from_hf_dict({**BASE, "architectures": ["Gemma3ForCausalLM"], "rope_scaling":
                               {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1e6, "head_dim": 8})
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    model_rope = RotaryEmbedding(cfg, get_backend("cpu", "numpy"))
    np.testing.assert_allclose(model_rope.inv_freq, plain_inv_freq(1e6, 8) / 8.0)


@pytest.mark.parametrize("key, value, match", [
    ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0 is not supported"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=True is not supported"),
    ("hidden_activation", "relu", "hidden_activation='relu' is not supported"),
])
def test_gemma3_what_it_cannot_run_is_refused_by_name(key, value, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf_dict({**BASE, "architectures": ["Gemma3ForCausalLM"], key: value})


def test_phi3_longrope_from_the_hub_spelling():
    """Phi-3-mini-128k writes rope_scaling {"type": "su" | "longrope", short/long factors} and the pretraining
    length at the top level; the cos/sin factor follows transformers: sqrt(1 + ln(s) / ln(original))."""
    factors = {"short_factor": [1.0, 1.5], "long_factor": [2.0, 4.0]}
    for kind in ("su", "longrope"):
        cfg = config_from_hf_dict({**BASE, "architectures": ["Phi3ForCausalLM"], "hidden_size": 8,
                                   "num_attention_heads": 2, "max_position_embeddings": 131072,
                                   "original_max_position_embeddings": 4096,
                                   "rope_scaling": {"type": kind, **factors}})
        assert cfg.rope_scaling["rope_type"] == "longrope"
        assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
        assert cfg.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    with pytest.raises(ValueError, match="short_factor has 3 entries, expected head_dim / 2 = 2"):
        bad = config_from_hf_dict({**BASE, "architectures": ["Phi3ForCausalLM"], "rope_scaling":
                                   {"type": "longrope", "short_factor": [1, 1, 1], "long_factor": [1, 1]}})
        RotaryEmbedding(bad, get_backend("cpu", "numpy"))


@pytest.mark.parametrize("arch, window", [("Phi3ForCausalLM", 2047), ("MistralForCausalLM", 4096)])
def test_a_phi3_or_mistral_sliding_window_covers_every_layer(arch, window):
    # Phi-3-mini-4k's 2047, Mistral-7B-v0.1's 4096: transformers masks every layer with it
    cfg = config_from_hf_dict({**BASE, "architectures": [arch], "sliding_window": window})
    assert [cfg.layer_window(n) for n in range(2)] == [window, window]
    assert config_from_hf_dict({**BASE, "architectures": [arch], "sliding_window": None}).layer_types == ()


def test_longrope_picks_factors_by_each_sequence_length(data_dir):
    """Rows of a sequence longer than the pretraining length (64) take the long factors and the others the
    short ones, in one batch; cos and sin carry the attention factor either way."""
    cfg = load_model(data_dir / "tiny-phi3").config
    rope = RotaryEmbedding(cfg, get_backend("cpu", "numpy"))
    f = cfg.rope_scaling["attention_factor"]
    batch = build_forward_batch([SeqChunk([5] * 3, 61, list(range(5))), SeqChunk([5] * 3, 62, list(range(5)))], BLOCK)
    cos, sin = rope.cos_sin(batch)
    short = np.cos(np.outer(batch.positions, rope.inv_freq)) * f
    long = np.cos(np.outer(batch.positions, rope.long_inv_freq)) * f
    np.testing.assert_allclose(cos[:3], short[:3], rtol=1e-6)  # seq_len 64: short
    np.testing.assert_allclose(cos[3:], long[3:], rtol=1e-6)  # seq_len 65: long
    assert not np.allclose(short[3:], long[3:], rtol=1e-3)
    assert sin.shape == cos.shape


def test_qwen3_sliding_layers_only_when_config_names_them():
    plain = config_from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "sliding_window": 4096,
                                 "layer_types": ["full_attention"] * 2})
    assert plain.layer_types == () and plain.layer_window(1) is None
    mixed = config_from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "sliding_window": 64,
                                 "use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"]})
    assert [mixed.layer_window(n) for n in range(2)] == [None, 64]
    older = config_from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "sliding_window": 64,
                                 "use_sliding_window": True, "max_window_layers": 1})  # no layer_types
    assert older == mixed
    off = config_from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "sliding_window": 64,
                               "use_sliding_window": False, "max_window_layers": 1})
    assert off.layer_types == ()


def test_llama32_is_the_llama_class_with_tied_embeddings_and_llama3_rope(data_dir):
    loaded = load_model(data_dir / "tiny-llama32")
    cfg = loaded.config
    assert registry.for_config(cfg) is registry.LLAMA and cfg.tie_word_embeddings
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 32.0
    assert "lm_head.weight" not in loaded.weights
    # the golden exercises all three bands of llama3 scaling: kept, interpolated and stretched frequencies
    inv = RotaryEmbedding(cfg, get_backend("cpu", "numpy")).inv_freq
    ratio = plain_inv_freq(cfg.rope_theta, cfg.head_dim) / inv
    assert np.isclose(ratio, 1).any() and np.isclose(ratio, 32).any() and ((ratio > 1.01) & (ratio < 31.9)).any()


# -- load-time reshaping ------------------------------------------------------------------------


def test_phi3_fused_weights_are_split_at_load(data_dir):
    stored = _stored(data_dir, "tiny-phi3")
    cfg, w = load_hf_weights(data_dir / "tiny-phi3")
    q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    qkv = stored["model.layers.1.self_attn.qkv_proj.weight"]
    np.testing.assert_array_equal(w["model.layers.1.self_attn.q_proj.weight"], qkv[:q])
    np.testing.assert_array_equal(w["model.layers.1.self_attn.k_proj.weight"], qkv[q:q + kv])
    np.testing.assert_array_equal(w["model.layers.1.self_attn.v_proj.weight"], qkv[q + kv:])
    gate_up = stored["model.layers.0.mlp.gate_up_proj.weight"]
    np.testing.assert_array_equal(w["model.layers.0.mlp.gate_proj.weight"], gate_up[:i])
    np.testing.assert_array_equal(w["model.layers.0.mlp.up_proj.weight"], gate_up[i:])
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in w)


def test_phi3_rank_slices_come_from_the_split_tensors(data_dir):
    full = load_model(data_dir / "tiny-phi3")
    part = load_model(data_dir / "tiny-phi3", shard=TPShard(1, 2))
    cfg, hd = full.config, full.config.head_dim
    for name, index in [("model.layers.0.self_attn.q_proj.weight", np.s_[2 * hd:4 * hd]),
                        ("model.layers.0.self_attn.k_proj.weight", np.s_[hd:2 * hd]),
                        ("model.layers.0.self_attn.v_proj.weight", np.s_[hd:2 * hd]),
                        ("model.layers.0.mlp.up_proj.weight", np.s_[64:128]),
                        ("model.layers.1.mlp.down_proj.weight", np.s_[:, 64:128]),
                        ("lm_head.weight", np.s_[256:512])]:
        np.testing.assert_array_equal(part.weights[name], full.weights[name][index], err_msg=name)
    registry.check_weights(cfg, part.weights, "rank 1", TPShard(1, 2))


def test_phi3_fused_tensor_of_the_wrong_size_is_named(data_dir, tmp_path):
    import shutil

    from safetensors.numpy import save_file

    d = tmp_path / "phi3"
    shutil.copytree(data_dir / "tiny-phi3", d)
    stored = _stored(data_dir, "tiny-phi3")
    stored["model.layers.0.self_attn.qkv_proj.weight"] = stored["model.layers.0.self_attn.qkv_proj.weight"][:-1]
    save_file(stored, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.self_attn.qkv_proj.weight' has 127 rows, "
                                         r"expected 128 from the config"):
        load_model(d)


def test_gemma3_norms_are_folded_at_load(data_dir):
    stored = _stored(data_dir, "tiny-gemma3")
    _, w = load_hf_weights(data_dir / "tiny-gemma3")
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.1.post_feedforward_layernorm.weight", "model.layers.1.self_attn.k_norm.weight"):
        np.testing.assert_array_equal(w[name], stored[name] + np.float32(1.0), err_msg=name)
    np.testing.assert_array_equal(w["model.layers.0.self_attn.q_proj.weight"],
                                  stored["model.layers.0.self_attn.q_proj.weight"])


def test_gelu_tanh_and_mul_is_transformers_formula():
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32) * 4
    g, u = x[:, :4].astype(np.float64), x[:, 4:].astype(np.float64)
    want = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * u
    np.testing.assert_allclose(gelu_tanh_and_mul(np, x), want, rtol=2e-6, atol=1e-6)


# -- GGUF ------------------------------------------------------------------------------------------


def _write_gguf(path, arch: str, cfg, weights, norm_offset: float = 0.0, extra=None) -> None:
    """A GGUF of `arch` as llama.cpp writes one: the registry's names, q/k rows as in the checkpoint (NeoX rope),
    Gemma's norms with the 1 of (1 + w) already added (`norm_offset`)."""
    import gguf

    entry = registry.lookup_gguf(arch)
    to_gguf = {hf: gg for gg, hf in entry.gguf_layer_names.items()}
    globals_ = {hf: gg for gg, hf in entry.gguf_global_names.items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    for name, t in weights.items():
        if name in globals_:
            gname = globals_[name]
        else:
            layer, rest = name.split(".")[2], name.split(".", 3)[3]
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{to_gguf[module]}.{kind}"
        if name.endswith("norm.weight"):
            t = t + norm_offset
        w.add_tensor(gname, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen3_gguf_loads_the_same_model(data_dir, tmp_path):
    loaded = load_model(data_dir / "tiny-qwen3")
    path = tmp_path / "qwen3.gguf"
    _write_gguf(path, "qwen3", loaded.config, loaded.weights)
    cfg, w = load_gguf_weights(path)
    assert cfg.architecture == "qwen3" and cfg.head_dim == 64 and cfg.tie_word_embeddings
    assert set(w) == set(loaded.weights)
    for name, t in loaded.weights.items():  # no un-permute: rows as they are
        np.testing.assert_array_equal(w[name], t, err_msg=name)


def test_gemma3_gguf_metadata_and_folded_norms(data_dir, tmp_path):
    """llama.cpp's gemma3 files: norms stored with the 1 added (loaded as they are), every 6th layer global,
    local rope base 10,000, the window from gemma3.attention.sliding_window, scale 1/sqrt(head_dim)."""
    loaded = load_model(data_dir / "tiny-gemma3")  # norms already folded by the HF loader
    path = tmp_path / "gemma3.gguf"
    _write_gguf(path, "gemma3", loaded.config, loaded.weights, extra={"attention.sliding_window": 8})
    cfg, w = load_gguf_weights(path)
    assert cfg.architecture == "gemma3" and cfg.sliding_window == 8 and cfg.rope_local_theta == 1e4
    assert cfg.query_pre_attn_scalar == 256.0 and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.layer_types == ("sliding_attention", "sliding_attention")  # 2 layers of the 5:1 pattern
    assert cfg.rope_scaling is None
    for name, t in loaded.weights.items():
        np.testing.assert_array_equal(w[name], t, err_msg=name)
    # the 4B and larger: linear rope scaling (factor 8) on the global layers
    _write_gguf(path, "gemma3", loaded.config, loaded.weights,
                extra={"attention.sliding_window": 8, "rope.scaling.type": "linear", "rope.scaling.factor": 8.0})
    assert load_gguf_weights(path)[0].rope_scaling == {"rope_type": "linear", "factor": 8.0}
    _write_gguf(path, "gemma3", loaded.config, loaded.weights, extra={"rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match="Gemma 3 GGUF with rope scaling 'yarn' is not supported"):
        load_gguf_weights(path)


def _write_phi3_gguf(path, loaded, qtype: str = "F32") -> None:
    """tiny-phi3 as llama.cpp's converter writes it: attn_qkv and ffn_up (gate and up) fused, LongRoPE's factors
    as rope_factors_short / rope_factors_long tensors, the lengths and cos/sin factor in the metadata."""
    import gguf

    cfg, w = loaded.config, loaded.weights
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_scaling_orig_ctx_len(cfg.rope_scaling["original_max_position_embeddings"])
    writer.add_rope_scaling_attn_factors(cfg.rope_scaling["attention_factor"])
    qt = gguf.GGMLQuantizationType[qtype]

    def add(name, t):
        t = np.ascontiguousarray(t, dtype=np.float32)
        if t.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(t, qt), raw_dtype=qt)
        else:
            writer.add_tensor(name, t)

    add("token_embd.weight", w["model.embed_tokens.weight"])
    add("output_norm.weight", w["model.norm.weight"])
    add("output.weight", w["lm_head.weight"])
    for kind in ("short", "long"):
        add(f"rope_factors_{kind}.weight", np.asarray(cfg.rope_scaling[f"{kind}_factor"]))
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        add(f"blk.{n}.attn_norm.weight", w[p + "input_layernorm.weight"])
        add(f"blk.{n}.attn_qkv.weight", np.concatenate([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
        add(f"blk.{n}.attn_output.weight", w[p + "self_attn.o_proj.weight"])
        add(f"blk.{n}.ffn_norm.weight", w[p + "post_attention_layernorm.weight"])
        add(f"blk.{n}.ffn_up.weight", np.concatenate([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]))
        add(f"blk.{n}.ffn_down.weight", w[p + "mlp.down_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _all_logits(model, ids):
    kv = allocate_kv_caches(model.config, 16, BLOCK, model.backend)
    batch = build_forward_batch([SeqChunk(ids, 0, list(range(-(-len(ids) // BLOCK))), num_logits=len(ids))], BLOCK)
    return model.forward(batch, kv)


def test_phi3_gguf_is_the_same_model_as_its_hf_directory(data_dir, tmp_path):
    """Fused tensors split, LongRoPE's factors from the file's tensors: the logits of a long (long factors) and a
    short prompt match the Hugging Face directory's to float32 rounding (the cos/sin factor went through the
    file as a float32)."""
    loaded = load_model(data_dir / "tiny-phi3")
    path = tmp_path / "phi3.gguf"
    _write_phi3_gguf(path, loaded)
    gcfg, gw = load_gguf_weights(path)
    assert gcfg.rope_scaling["rope_type"] == "longrope" and gcfg.rope_scaling["short_factor"] is None
    assert gcfg.rope_scaling["original_max_position_embeddings"] == 64 and not gcfg.layer_types
    hf = registry.PHI3.model_class(loaded.config, loaded.weights)
    from_gguf = registry.PHI3.model_class(gcfg, gw)
    for n in (120, 33):
        ids = np.random.default_rng(n).integers(3, 512, size=n).tolist()
        assert_close_model(_all_logits(from_gguf, ids), _all_logits(hf, ids), loaded.config)


def test_phi3_q8_gguf_keeps_blocks_of_the_split_weights(data_dir, tmp_path):
    """A Q8_0 file's fused blocks are split by rows like the float32 weights: the numba set reads q/k/v and
    gate/up from blocks in few-row decodes, and gives the reference's logits."""
    loaded = load_model(data_dir / "tiny-phi3")
    path = tmp_path / "phi3-q8.gguf"
    _write_phi3_gguf(path, loaded, "Q8_0")
    gcfg, gw = load_gguf_weights(path)
    assert not any(".qkv_proj." in n or ".gate_up_proj." in n for n in gw)
    numba_model = registry.PHI3.model_class(gcfg, gw, get_backend("cpu", "numba"))
    assert numba_model.quantized_matmuls == 1 + 4 * gcfg.num_hidden_layers  # lm_head + qkv, o, gate_up, down
    reference = registry.PHI3.model_class(gcfg, gw, get_backend("cpu", "numpy"))
    out = {}
    for name, model in (("numba", numba_model), ("numpy", reference)):
        kv = allocate_kv_caches(gcfg, 16, BLOCK, model.backend)
        prompts, tables = [list(range(3, 40)), list(range(50, 60))], [[0, 1, 2], [3]]
        model.forward(build_forward_batch([SeqChunk(p, 0, t, num_logits=0) for p, t in zip(prompts, tables)], BLOCK),
                      kv)
        decode = [SeqChunk([7], len(p), t) for p, t in zip(prompts, tables)]  # 2 rows: the blocks on numba
        out[name] = model.forward(build_forward_batch(decode, BLOCK), kv)
    assert_close_model(out["numba"], out["numpy"], gcfg)
    assert (out["numba"].argmax(1) == out["numpy"].argmax(1)).all()


def test_a_longrope_config_without_factors_is_refused_by_name(data_dir, tmp_path):
    loaded = load_model(data_dir / "tiny-phi3")
    path = tmp_path / "phi3.gguf"
    _write_phi3_gguf(path, loaded)
    gcfg, gw = load_gguf_weights(path)
    gw.pop("rope_factors_long")
    with pytest.raises(ValueError, match="longrope rope scaling without its long_factor .*rope_factors_long"):
        registry.PHI3.model_class(gcfg, gw)


# -- kernel sets -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_numba_matches_the_reference_on_a_mixed_batch(data_dir, name):
    """Each family's forward with the numba op table against the numpy one, on a batch mixing fresh prompts, a
    chunk ending mid-block and a long sequence's later chunk (tiny-gemma3: 40 tokens past its window of 8)."""
    loaded = load_model(data_dir / name)
    cls = registry.for_config(loaded.config).model_class
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, loaded.config.vocab_size, size=n).tolist() for n in (1, 9, 40, 70)]
    tables = np.split(rng.permutation(40), 4)
    out = {}
    for kernels in ("numpy", "numba"):
        model = cls(loaded.config, loaded.weights, get_backend("cpu", kernels))
        kv = allocate_kv_caches(loaded.config, 40, BLOCK, model.backend)
        model.forward(build_forward_batch([SeqChunk(prompts[3][:50], 0, tables[3].tolist(), num_logits=0)], BLOCK),
                      kv)
        step = [SeqChunk(prompts[0], 0, tables[0].tolist()), SeqChunk(prompts[3][50:], 50, tables[3].tolist()),
                SeqChunk(prompts[1], 0, tables[1].tolist()), SeqChunk(prompts[2][:23], 0, tables[2].tolist())]
        out[kernels] = model.forward(build_forward_batch(step, BLOCK), kv)
    assert_close_model(out["numba"], out["numpy"], loaded.config)
    assert (out["numba"].argmax(1) == out["numpy"].argmax(1)).all()


def test_family_classes():
    assert registry.lookup_hf("Qwen3ForCausalLM").model_class is Qwen3ForCausalLM
    assert registry.lookup_hf("Gemma3ForCausalLM").model_class is Gemma3ForCausalLM
    assert registry.lookup_gguf("qwen3").gguf_qk_permuted is False
    assert registry.lookup_gguf("gemma3").gguf_qk_permuted is False
