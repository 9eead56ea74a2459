"""The numpy forward pass against Hugging Face transformers (float32 CPU) through committed golden files.

scripts/make_goldens.py wrote tests/data/goldens/<model>.npz with the oracle; no torch is needed here.
"""

from __future__ import annotations

import numpy as np
import pytest
from numerics import max_abs, model_tol

from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models import registry
from pagedserve.models.kv_cache import allocate_kv_caches
from pagedserve.models.loading.loader import load_model

BLOCK = 16
# One tiny checkpoint per family (tests/data/README.md): Llama 3 (untied, llama3 rope), Qwen2 (bias, tied),
# Qwen3 (qk-norm), Phi-3 (fused weights, longrope), Gemma 3 (sliding window 8, head_dim 256, ...), Llama 3.2 (tied,
# llama3 rope factor 32).
TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-phi3", "tiny-gemma3", "tiny-llama32"]
MODELS = [pytest.param("smollm2", marks=pytest.mark.slow), *TINY]


@pytest.fixture(scope="module")
def models(data_dir, smollm2_model):
    out = {"smollm2": smollm2_model}
    for name in TINY:
        loaded = load_model(data_dir / name)
        out[name] = registry.for_config(loaded.config).model_class(loaded.config, loaded.weights)
    return out


def golden(data_dir, name):
    g = np.load(data_dir / "goldens" / f"{name}.npz")
    return [{k: g[f"{k}_{i}"] for k in ("prompt_ids", "topk_ids", "topk_logits", "greedy_ids")}
            for i in range(int(g["num_prompts"]))]


def prompt_logits(model, ids, chunk=None):
    """Logits at every prompt position: one forward, or chunks of `chunk` tokens through a shuffled table."""
    nblocks = -(-len(ids) // BLOCK) + 1
    kv = allocate_kv_caches(model.config, 2 * nblocks, BLOCK, model.backend)
    table = np.random.default_rng(1).permutation(2 * nblocks)[:nblocks].tolist()
    out, chunk = [], chunk or len(ids)
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        batch = build_forward_batch([SeqChunk(part, start, table, num_logits=len(part), prompt_len=len(ids))], BLOCK)
        out.append(model.forward(batch, kv))
    return np.concatenate(out)


def check_logits(model, name, cases, chunk=None):
    worst_allowed = 0.0
    for case in cases:
        logits = prompt_logits(model, case["prompt_ids"].tolist(), chunk)
        ours = np.take_along_axis(logits, case["topk_ids"], axis=1)
        diff = np.abs(ours - case["topk_logits"]).max()
        # transformers (float32) sums in its own order: the difference is rounding, within the model's tolerance
        allowed = model_tol(model.config, max_abs(case["topk_logits"]))
        worst_allowed = max(worst_allowed, allowed)
        assert diff <= allowed, (f"{name} (chunk {chunk}): max |logit - oracle| = {diff:.2e} > {allowed:.2e} over "
                                 f"the golden top-k")
    assert worst_allowed < 1e-2  # the tolerance itself stays far below what a wrong logit would move


def greedy_paged(model, prompt, num_tokens):
    """Prefill, then one token at a time through a shuffled, non-contiguous block table."""
    total = len(prompt) + num_tokens
    nblocks = -(-total // BLOCK)
    table = np.random.default_rng(0).permutation(nblocks * 2)[:nblocks].tolist()
    kv = allocate_kv_caches(model.config, nblocks * 2, BLOCK, model.backend)
    tokens = list(prompt)
    batch = build_forward_batch([SeqChunk(tokens, 0, table)], BLOCK)
    out = []
    for _ in range(num_tokens):
        nxt = int(np.argmax(model.forward(batch, kv)[-1]))
        out.append(nxt)
        batch = build_forward_batch([SeqChunk([nxt], len(tokens), table)], BLOCK)
        tokens.append(nxt)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_prompt_logits_match_oracle(models, data_dir, name):
    check_logits(models[name], name, golden(data_dir, name))


@pytest.mark.parametrize("name", TINY)
def test_chunked_prompt_logits_match_oracle(models, data_dir, name):
    """The prompt in chunks of 5 (across block edges and, for tiny-gemma3, well past its window of 8) gives the
    oracle's logits. tiny-phi3's 120-token prompt is past its pretraining length (64): every chunk, those ending
    within 64 too, takes the long factors by the prompt's length (models/rope.py), as the oracle's one forward."""
    cases = golden(data_dir, name)
    if name == "tiny-phi3":
        assert max(len(c["prompt_ids"]) for c in cases) > models[name].config.rope_scaling[
            "original_max_position_embeddings"]
    check_logits(models[name], name, cases, chunk=5)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_ids_match_oracle(models, data_dir, name):
    for i, case in enumerate(golden(data_dir, name)):
        got = greedy_paged(models[name], case["prompt_ids"].tolist(), len(case["greedy_ids"]))
        assert got == case["greedy_ids"].tolist(), f"{name} prompt {i}"
