"""GGUF loading: metadata -> config, dequantization, and llama.cpp's q/k row permutation undone."""

from __future__ import annotations

import numpy as np
import pytest
from model_factory import random_model, write_gguf
from numerics import assert_close_model

from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.cupy_kernels.backend import get_backend
from pagedserve.models.gguf_loader import load_gguf_weights, unpermute_qk
from pagedserve.models.kv_cache import allocate_kv_caches
from pagedserve.models.llama import LlamaForCausalLM


def logits(cfg, weights, ids):
    model = LlamaForCausalLM(cfg, weights)
    kv = allocate_kv_caches(cfg, 8, 16, get_backend("cpu"))
    batch = build_forward_batch([SeqChunk(ids, 0, [3, 1, 4, 0])], 16)
    batch.logits_indices = np.arange(len(ids))
    return model.forward(batch, kv)


def test_unpermute_inverts_llama_cpp_permutation():
    from model_factory import llama_cpp_permute

    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(w, 4), 4), w)
    b = np.arange(32, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(b, 2), 2), b)


def test_f32_gguf_gives_the_same_logits_as_the_hf_layout(tmp_path):
    cfg, w = random_model("llama", seed=11, heads=4, kv_heads=2)
    path = tmp_path / "m.gguf"
    write_gguf(path, cfg, w, "F32")
    gcfg, gw = load_gguf_weights(path)
    assert (gcfg.num_attention_heads, gcfg.num_key_value_heads, gcfg.hidden_size) == (4, 2, cfg.hidden_size)
    assert gcfg.tie_word_embeddings is False
    for name in w:
        np.testing.assert_array_equal(gw[name], w[name], err_msg=name)
    ids = list(range(1, 30))
    assert_close_model(logits(gcfg, gw, ids), logits(cfg, w, ids), cfg)


@pytest.mark.parametrize("qtype,tol", [("F16", 2e-3), ("Q8_0", 2e-2), ("Q4_0", 0.3), ("Q4_1", 0.3)])
def test_quantized_types_dequantize_to_the_quantized_values(tmp_path, qtype, tol):
    import gguf

    cfg, w = random_model("llama", seed=12, hidden=64, head_dim=16)  # rows of 64: whole quant blocks
    path = tmp_path / f"m-{qtype}.gguf"
    write_gguf(path, cfg, w, qtype)
    _, gw = load_gguf_weights(path)
    name = "model.layers.0.mlp.up_proj.weight"
    q = gguf.GGMLQuantizationType[qtype]
    expected = w[name].astype(np.float16).astype(np.float32) if qtype == "F16" else \
        gguf.quants.dequantize(gguf.quants.quantize(w[name], q), q)
    np.testing.assert_array_equal(gw[name], expected)
    # q/k go through the permutation as well as the quantization: close to the originals.
    qname = "model.layers.1.self_attn.q_proj.weight"
    assert np.abs(gw[qname] - w[qname]).max() <= tol * np.abs(w[qname]).max()


def test_tied_embeddings_when_output_weight_is_absent(tmp_path):
    cfg, w = random_model("llama", seed=13)
    w.pop("lm_head.weight")
    from dataclasses import replace

    cfg = replace(cfg, tie_word_embeddings=True)
    path = tmp_path / "tied.gguf"
    write_gguf(path, cfg, w)
    gcfg, gw = load_gguf_weights(path)
    assert gcfg.tie_word_embeddings and "lm_head.weight" not in gw


def test_missing_and_corrupt_files_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="nope.gguf.*not found"):
        load_gguf_weights(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ValueError, match="bad.gguf.*corrupt"):
        load_gguf_weights(bad)
    cfg, w = random_model("llama", seed=14)
    good = tmp_path / "trunc.gguf"
    write_gguf(good, cfg, w)
    good.write_bytes(good.read_bytes()[:-4096])
    with pytest.raises(ValueError, match="trunc.gguf"):
        load_gguf_weights(good)


def test_unsupported_architecture(tmp_path):
    cfg, w = random_model("llama", seed=15)
    path = tmp_path / "falcon.gguf"
    write_gguf(path, cfg, w, arch="falcon")
    with pytest.raises(ValueError, match="falcon.gguf.*unsupported GGUF architecture 'falcon'"):
        load_gguf_weights(path)
