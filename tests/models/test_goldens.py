"""The numpy forward pass against Hugging Face transformers (float32 CPU) through committed golden files.

scripts/make_goldens.py wrote tests/data/goldens/<model>.npz with the oracle; no torch is needed here.
"""

from __future__ import annotations

import numpy as np
import pytest
from numerics import max_abs, model_tol

from pagedserve.cupy_kernels.backend import get_backend
from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.kv_cache import allocate_kv_caches
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.loading.loader import load_model

BLOCK = 16
MODELS = [pytest.param("smollm2", marks=pytest.mark.slow), "tiny-llama", "tiny-qwen2"]


@pytest.fixture(scope="module")
def models(data_dir, smollm2_model):
    out = {"smollm2": smollm2_model}
    for name in ("tiny-llama", "tiny-qwen2"):
        loaded = load_model(data_dir / name)
        out[name] = LlamaForCausalLM(loaded.config, loaded.weights)
    return out


def golden(data_dir, name):
    g = np.load(data_dir / "goldens" / f"{name}.npz")
    return [{k: g[f"{k}_{i}"] for k in ("prompt_ids", "topk_ids", "topk_logits", "greedy_ids")}
            for i in range(int(g["num_prompts"]))]


def prompt_logits(model, ids):
    kv = allocate_kv_caches(model.config, -(-len(ids) // BLOCK) + 1, BLOCK, get_backend("cpu"))
    batch = build_forward_batch([SeqChunk(ids, 0, list(range(len(kv[0][0]))))], BLOCK)
    batch.logits_indices = np.arange(len(ids))
    return model.forward(batch, kv)


def greedy_paged(model, prompt, num_tokens):
    """Prefill, then one token at a time through a shuffled, non-contiguous block table."""
    total = len(prompt) + num_tokens
    nblocks = -(-total // BLOCK)
    table = np.random.default_rng(0).permutation(nblocks * 2)[:nblocks].tolist()
    kv = allocate_kv_caches(model.config, nblocks * 2, BLOCK, get_backend("cpu"))
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
    worst = worst_allowed = 0.0
    for case in golden(data_dir, name):
        logits = prompt_logits(models[name], case["prompt_ids"].tolist())
        ours = np.take_along_axis(logits, case["topk_ids"], axis=1)
        diff = np.abs(ours - case["topk_logits"]).max()
        # transformers (float32) sums in its own order: the difference is rounding, within the model's tolerance
        allowed = model_tol(models[name].config, max_abs(case["topk_logits"]))
        worst, worst_allowed = max(worst, float(diff)), max(worst_allowed, allowed)
        assert diff <= allowed, f"{name}: max |logit - oracle| = {diff:.2e} > {allowed:.2e} over the golden top-k"
    assert worst_allowed < 1e-2  # the tolerance itself stays far below what a wrong logit would move


@pytest.mark.parametrize("name", MODELS)
def test_greedy_ids_match_oracle(models, data_dir, name):
    for i, case in enumerate(golden(data_dir, name)):
        got = greedy_paged(models[name], case["prompt_ids"].tolist(), len(case["greedy_ids"]))
        assert got == case["greedy_ids"].tolist(), f"{name} prompt {i}"
