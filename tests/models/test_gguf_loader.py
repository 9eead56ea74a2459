"""GGUF loading: metadata -> config, dequantization, and llama.cpp's q/k row permutation undone."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from model_factory import random_model, write_gguf
from numerics import assert_close_model, model_tol

from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.cupy_kernels.backend import get_backend
from pagedserve.cupy_kernels.reference.quant import dequantize
from pagedserve.models.loading import weight_cache
from pagedserve.models.loading.gguf_loader import is_quant_name, load_gguf_weights, quant_weight, unpermute_qk
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


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_quantized_matmuls_keep_their_blocks_and_decode_as_the_float32_weights(tmp_path, qtype):
    """A Q8_0/Q4_1 file's matmul weights are kept as blocks too (through the conversion cache, q/k rows
    un-permuted like the float32 weights), and the numba set's decode rows, which read the blocks, give the
    numpy reference's logits (float32 weights) to float32 rounding."""
    cfg, w = random_model("llama", seed=14, hidden=64, head_dim=16, heads=4, kv_heads=2)
    w.pop("lm_head.weight")
    cfg = replace(cfg, tie_word_embeddings=True)
    path = tmp_path / f"m-{qtype}.gguf"
    write_gguf(path, cfg, w, qtype)
    gcfg, gw = load_gguf_weights(path)
    stale = weight_cache.entry_dir(tmp_path / "cache", "d").with_name(f"gguf-d-v{weight_cache.CACHE_FORMAT - 1}")
    stale.mkdir(parents=True)
    weight_cache.save_entry(tmp_path / "cache", "d", gcfg, gw, {})
    assert not stale.exists()  # an entry of the same file in the previous format is removed
    _, cached, _ = weight_cache.load_entry(tmp_path / "cache", "d")
    assert set(cached) == set(gw)
    for weights in (gw, cached):
        matmuls = [n for n, a in weights.items() if a.ndim == 2 and not is_quant_name(n)]
        assert len(matmuls) == 1 + 7 * cfg.num_hidden_layers
        for name in matmuls:
            np.testing.assert_array_equal(dequantize(quant_weight(weights, name)), weights[name], name)
    numba_model = LlamaForCausalLM(gcfg, cached, get_backend("cpu", "numba"))
    reference = LlamaForCausalLM(gcfg, cached, get_backend("cpu", "numpy"))
    assert numba_model.quantized_matmuls == 1 + 4 * gcfg.num_hidden_layers  # lm_head (tied) + 4 per layer
    assert reference.quantized_matmuls == 0
    prompts = [list(range(1, 20)), list(range(30, 41)), [7, 8, 9]]
    outs = {}
    for name, model in (("numba", numba_model), ("numpy", reference)):
        kv = allocate_kv_caches(gcfg, 16, 16, model.backend)
        tables = [[0, 1], [2, 3], [4, 5]]
        prefill = build_forward_batch([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], 16)
        model.forward(prefill, kv)
        decode = build_forward_batch([SeqChunk([5 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts, tables))], 16)  # noqa: E501
        outs[name] = model.forward(decode, kv)  # 3 rows: the blocks on numba
    scale = float(np.abs(outs["numpy"]).max())
    np.testing.assert_allclose(outs["numba"], outs["numpy"], rtol=0, atol=model_tol(gcfg, scale))
    assert (outs["numba"].argmax(axis=1) == outs["numpy"].argmax(axis=1)).all()


def test_batch_invariant_mode_gives_a_decode_row_the_same_bits_in_any_batch(tmp_path, monkeypatch):
    """PAGEDSERVE_BATCH_INVARIANT: every matmul on the packed GEMM (never the block kernel for few rows),
    so one sequence's decode logits are the same bits alone and beside 11 others (past the switch at QUANT_MAX_ROWS)."""
    from pagedserve.cupy_kernels.numba_cpu import setup as numba_setup

    cfg, w = random_model("llama", seed=15, hidden=64, head_dim=16, heads=4, kv_heads=2)
    path = tmp_path / "m.gguf"
    write_gguf(path, cfg, w, "Q4_1")
    gcfg, gw = load_gguf_weights(path)
    model = LlamaForCausalLM(gcfg, gw, get_backend("cpu", "numba"))
    assert model.quantized_matmuls > 0
    kv = allocate_kv_caches(gcfg, 32, 16, model.backend)
    prompts = [[(3 * i + j) % 90 + 1 for j in range(5 + i)] for i in range(12)]
    tables = [[2 * i, 2 * i + 1] for i in range(12)]
    model.forward(build_forward_batch([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], 16), kv)

    def decode(rows):
        return model.forward(build_forward_batch([SeqChunk([7], len(prompts[i]), tables[i]) for i in rows], 16), kv)

    monkeypatch.setattr(numba_setup, "BATCH_INVARIANT", True)
    alone, batch = decode([0]), decode(range(12))
    np.testing.assert_array_equal(alone[0], batch[0])
    monkeypatch.setattr(numba_setup, "BATCH_INVARIANT", False)  # one row on the blocks: float32 rounding apart
    np.testing.assert_allclose(decode([0])[0], alone[0], rtol=0, atol=model_tol(gcfg, float(np.abs(alone).max())))
