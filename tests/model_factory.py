"""Small random-weight models for tests that need a model but not a particular one."""

from __future__ import annotations

import json
import shutil

import numpy as np

from pagedserve.models.config import ModelConfig


def random_model(arch: str = "llama", seed: int = 0, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 16, hidden: int = 48, vocab: int = 97) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A random Llama-family model with peaky logits (so greedy decisions are not coin flips)."""
    rng = np.random.default_rng(seed)
    cfg = ModelConfig(architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
                      tie_word_embeddings=arch == "qwen2", attention_bias=arch == "qwen2")
    from pagedserve.models.llama import expected_shapes

    weights = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) * (1.0 if "embed" in name else 0.3)).astype(np.float32)
    return cfg, weights


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, cfg: ModelConfig, weights: dict[str, np.ndarray], qtype_name: str = "F32",
               arch: str = "llama", extra_meta=None, extra_tensors: dict[str, np.ndarray] | None = None,
               rope_dims: int | None = None) -> None:
    """Write a llama GGUF the way llama.cpp's converter would (matrices in `qtype_name`, norms F32).
    extra_meta(writer) adds metadata; extra_tensors (GGUF names) are written as float32; rope_dims: the rotary
    width written (head_dim by default)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    w = gguf.GGUFWriter(str(path), arch)
    if extra_meta is not None:
        extra_meta(w)
    for gname, t in (extra_tensors or {}).items():
        w.add_tensor(gname, np.ascontiguousarray(t, dtype=np.float32))
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(rope_dims or cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for name, t in weights.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            gname = f"blk.{layer}.{_GGUF_NAMES[rest]}"
            if rest == "self_attn.q_proj.weight":
                t = llama_cpp_permute(t, cfg.num_attention_heads)
            elif rest == "self_attn.k_proj.weight":
                t = llama_cpp_permute(t, cfg.num_key_value_heads)
        if t.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, np.ascontiguousarray(t, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, np.ascontiguousarray(t, dtype=np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(t, dtype=np.float32), qtype),
                         raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def edited_copy(data_dir, tmp_path, name: str, edit: dict | None = None, tensors: dict | None = None):
    """A copy of tests/data/<name> with config.json keys set by `edit` and `tensors` added in a file of their
    own (named in the shard index when there is one)."""
    from safetensors.numpy import save_file

    from pagedserve.models.loading.hf_loader import INDEX_FILE

    d = tmp_path / name
    shutil.copytree(data_dir / name, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(edit or {})
    (d / "config.json").write_text(json.dumps(cfg))
    if tensors:
        save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
                  str(d / "extra.safetensors"))
        index = d / INDEX_FILE
        if index.is_file():
            data = json.loads(index.read_text())
            data["weight_map"].update({k: "extra.safetensors" for k in tensors})
            index.write_text(json.dumps(data))
    return d


def stored_weights(data_dir, name: str) -> dict[str, np.ndarray]:
    from pagedserve.models.loading.safetensors_io import read_safetensors

    out = {}
    for f in sorted((data_dir / name).glob("*.safetensors")):
        out.update(read_safetensors(f))
    return out


def random_biases(data_dir, name: str, modules: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Random biases of `modules` ("self_attn.o_proj", ...) for every layer of tests/data/<name>, sized from the
    stored weights."""
    weights, rng = stored_weights(data_dir, name), np.random.default_rng(0)
    out = {}
    for key, w in weights.items():
        layer_leaf = key.split(".", 3)
        if len(layer_leaf) == 4 and layer_leaf[3].removesuffix(".weight") in modules:
            out[key.removesuffix(".weight") + ".bias"] = 0.5 * rng.standard_normal(w.shape[0])
    return out
