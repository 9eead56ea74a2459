"""Decoding through the paged cache must not depend on how the work is cut up or where blocks live."""

from __future__ import annotations

import numpy as np
import pytest
from model_factory import random_model
from numerics import assert_close_model

from pagedserve.cupy_kernels.backend import get_backend
from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.kv_cache import allocate_kv_caches
from pagedserve.models.llama import LlamaForCausalLM

BLOCK = 16


def run_in_chunks(model, tokens, chunk_sizes, block_table, num_blocks=64):
    """Feed `tokens` in chunks of the given sizes; return logits at every position [len(tokens), V]."""
    kv = allocate_kv_caches(model.config, num_blocks, BLOCK, get_backend("cpu"))
    out, done, i = [], 0, 0
    while done < len(tokens):
        n = min(chunk_sizes[min(i, len(chunk_sizes) - 1)], len(tokens) - done)
        batch = build_forward_batch([SeqChunk(tokens[done:done + n], done, block_table)], BLOCK)
        batch.logits_indices = np.arange(n)
        out.append(model.forward(batch, kv))
        done += n
        i += 1
    return np.concatenate(out)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_full_pass_equals_chunked_and_token_by_token(arch):
    cfg, w = random_model(arch, seed=3)
    model = LlamaForCausalLM(cfg, w)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, size=150).tolist()
    table = rng.permutation(64)[:10].tolist()  # deliberately shuffled, non-contiguous blocks
    full = run_in_chunks(model, tokens, [len(tokens)], table)
    for chunks in ([7], [16], [100], [1], [40, 1]):
        other_table = rng.permutation(64)[:10].tolist()
        got = run_in_chunks(model, tokens, chunks, other_table)
        assert_close_model(got, full, cfg, err_msg=f"chunks={chunks}")
        assert (got.argmax(1) == full.argmax(1)).all(), f"chunks={chunks}"


def test_mixed_batch_equals_sequences_alone():
    """Prefill chunks and decodes of several sequences in one flat batch give each one's solo logits."""
    cfg, w = random_model("llama", seed=5)
    model = LlamaForCausalLM(cfg, w)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (1, 17, 33, 64)]
    tables = np.split(rng.permutation(40), 4)
    solo = [run_in_chunks(model, p, [len(p)], t.tolist())[-1] for p, t in zip(prompts, tables)]
    kv = allocate_kv_caches(cfg, 40, BLOCK, get_backend("cpu"))
    # Step 1: sequences 2 and 3 prefill all but their last token; step 2 mixes their last tokens
    # (decodes) with full prefills of sequences 0 and 1.
    step1 = [SeqChunk(prompts[i][:-1], 0, tables[i].tolist(), num_logits=0) for i in (2, 3)]
    model.forward(build_forward_batch(step1, BLOCK), kv)
    step2 = [SeqChunk(prompts[0], 0, tables[0].tolist()), SeqChunk(prompts[2][-1:], 32, tables[2].tolist()),
             SeqChunk(prompts[1], 0, tables[1].tolist()), SeqChunk(prompts[3][-1:], 63, tables[3].tolist())]
    mixed = model.forward(build_forward_batch(step2, BLOCK), kv)
    for row, i in enumerate((0, 2, 1, 3)):
        assert_close_model(mixed[row], solo[i], cfg)
        assert mixed[row].argmax() == solo[i].argmax()


@pytest.mark.slow
def test_smollm2_prefill_then_decode_matches_full_pass(smollm2_model):
    model = smollm2_model
    tokens = np.random.default_rng(2).integers(0, model.config.vocab_size, size=40).tolist()
    full = run_in_chunks(model, tokens, [40], list(range(8)))
    stepped = run_in_chunks(model, tokens, [16, 7, 1], [5, 3, 7, 1, 0, 2, 4, 6])
    assert_close_model(stepped, full, model.config)
    assert (stepped.argmax(1) == full.argmax(1)).all()


def test_numba_kernels_match_the_reference_on_a_mixed_batch():
    """The whole forward with the numba op table against the numpy one: prefill chunks, a chunk ending
    mid-block and decodes in one batch, GQA (tiny llama: 4 heads over 2 kv heads). Same tokens; logits
    within the float32 rounding of a forward pass."""
    cfg, w = random_model("llama", seed=6)
    models = {k: LlamaForCausalLM(cfg, w, get_backend("cpu", k)) for k in ("numpy", "numba")}
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (1, 9, 40, 70)]
    tables = np.split(rng.permutation(40), 4)
    out = {}
    for k, model in models.items():
        kv = allocate_kv_caches(cfg, 40, BLOCK, model.backend)
        model.forward(build_forward_batch([SeqChunk(prompts[3][:50], 0, tables[3].tolist(), num_logits=0)],
                                          BLOCK), kv)
        step = [SeqChunk(prompts[0], 0, tables[0].tolist()), SeqChunk(prompts[3][50:], 50, tables[3].tolist()),
                SeqChunk(prompts[1], 0, tables[1].tolist()), SeqChunk(prompts[2][:23], 0, tables[2].tolist())]
        out[k] = model.forward(build_forward_batch(step, BLOCK), kv)
    assert_close_model(out["numba"], out["numpy"], cfg)
    assert (out["numba"].argmax(1) == out["numpy"].argmax(1)).all()


def test_cpu_kv_pool_is_zeroed_writable_and_separate_per_layer():
    """The CPU pool comes from anonymous memory (kv_cache.host_zeros), not numpy's allocator: it must
    still be zero, writable, C-contiguous, and every layer's K and V their own memory."""
    cfg = random_model(layers=3)[0]
    kv = allocate_kv_caches(cfg, 5, BLOCK, get_backend("cpu"))
    arrays = [a for pair in kv for a in pair]
    assert len(arrays) == 6
    for a in arrays:
        assert a.shape == (5, BLOCK, cfg.num_key_value_heads, cfg.head_dim) and a.dtype == np.float32
        assert a.flags.c_contiguous and a.flags.writeable and not a.any()
    arrays[2][3, 1] = 7.0
    assert arrays[2].sum() == 7.0 * cfg.num_key_value_heads * cfg.head_dim
    assert all(not a.any() for i, a in enumerate(arrays) if i != 2)


def test_host_zeros_of_no_elements():
    from pagedserve.models.kv_cache import host_zeros

    assert host_zeros((0, BLOCK, 2, 8), np.float32).shape == (0, BLOCK, 2, 8)


def test_host_zeros_says_what_it_could_not_map(monkeypatch):
    import mmap

    from pagedserve.models import kv_cache

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(kv_cache.mmap, "mmap", refuse)
    with pytest.raises(MemoryError, match=r"cannot map 0\.25 GiB for a KV cache array of shape \(8192, 16, 2, 256\).*"
                                          r"Cannot allocate memory; lower kv_cache_memory_bytes"):
        kv_cache.host_zeros((8192, 16, 2, 256), np.float32)
    assert mmap.mmap is refuse
