"""Every family through the whole engine: one request of each kind (guided decoding, n-gram speculative decoding,
a prefix-cache hit, n > 1, beam search), and tensor parallelism where the heads split.

The families' tiny checkpoints (tests/data/README.md): tiny-qwen3 (qk-norm), tiny-phi3 (split fused weights,
LongRoPE), tiny-gemma3 (a sliding layer with window 8 beside a global one), tiny-llama32 (tied, llama3 rope).
Their logits against transformers are test_goldens.py's; here the claim is that the engine's features work on
them: constrained text obeys its constraint, speculation keeps the greedy tokens, a cache hit keeps them too,
samples and beams come back whole, and no KV block leaks (engine_helpers.drain).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from engine_helpers import drain, make_engine, tiny_loaded
from numerics import assert_close_model

from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.core.beam_search import BeamSearchParams
from pagedserve.runtime.engine.llm_engine import LLMEngine
from pagedserve.runtime.sampling_params import SamplingParams
from pagedserve.runtime.structured_outputs_params import StructuredOutputsParams
from pagedserve.runtime.worker.worker import ExecuteModelRequest

FAMILIES = ["tiny-qwen3", "tiny-phi3", "tiny-gemma3", "tiny-llama32"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
         "min_acceptance_rate": 0.0}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# 36 tokens that repeat (the n-gram proposer finds its drafts), then a 40-token prompt sharing its first 32
# (two full blocks of 16: a prefix-cache hit); both run well past tiny-gemma3's window of 8.
REPEATING = [11, 12, 13, 14, 15, 16] * 6
SHARED = list(range(40, 72))


@pytest.mark.parametrize("name", FAMILIES)
def test_each_request_kind_on_each_family(name):
    loaded = tiny_loaded(name)
    engine = make_engine(loaded, enable_prefix_caching=True, block_size=16)
    engine.add_request("greedy", REPEATING, GREEDY)
    engine.add_request("first", SHARED + [5, 6], GREEDY)
    choice = StructuredOutputsParams(choice=["Paris", "Rome", "Berlin"])
    engine.add_request("guided", "The capital is", SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                                                                 structured_outputs=choice))
    engine.add_request("regex", "Count:", SamplingParams(temperature=1.0, seed=4, max_tokens=12,
                                                        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}")))
    engine.add_request("samples", [3, 4, 5], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6))
    engine.add_beam_request("beams", [7, 8, 9, 10], BeamSearchParams(beam_width=3, max_tokens=5))
    done = drain(engine, max_steps=400)
    assert done["guided"].outputs[0].text in ("Paris", "Rome", "Berlin")
    assert re.fullmatch(r"[0-9]{3}", done["regex"].outputs[0].text)
    assert len(done["samples"].outputs) == 3 and all(len(c.token_ids) == 6 for c in done["samples"].outputs)
    beams = done["beams"].outputs
    assert len(beams) == 3 and len({tuple(c.token_ids) for c in beams}) == 3
    assert beams[0].cumulative_logprob >= beams[1].cumulative_logprob >= beams[2].cumulative_logprob

    # A prompt sharing the first one's two full blocks reuses them, with the tokens of a cold engine.
    engine.add_request("hit", SHARED + [8, 9, 10, 11, 12, 13, 14, 15], GREEDY)
    hit = drain(engine, max_steps=100)["hit"]
    assert hit.num_cached_tokens == 32
    cold = make_engine(loaded, enable_prefix_caching=False, block_size=16)
    cold.add_request("hit", SHARED + [8, 9, 10, 11, 12, 13, 14, 15], GREEDY)
    assert drain(cold, max_steps=100)["hit"].outputs[0].token_ids == hit.outputs[0].token_ids

    # n-gram speculation verifies drafts and keeps the greedy tokens.
    spec = make_engine(loaded, speculative_config=NGRAM, block_size=16)
    spec.add_request("greedy", REPEATING, GREEDY)
    assert drain(spec, max_steps=100)["greedy"].outputs[0].token_ids == done["greedy"].outputs[0].token_ids
    assert spec.spec.stats.num_draft_tokens > 0


def _prefill_logits(engine: LLMEngine, ids: list[int]) -> np.ndarray:
    table = list(range(-(-len(ids) // engine.block_size)))
    batch = build_forward_batch([SeqChunk(ids, 0, table, num_logits=len(ids))], engine.block_size)
    return np.asarray(engine.executor.execute_model(ExecuteModelRequest(batch)))


@pytest.mark.parametrize("name", FAMILIES)
def test_tp2_is_the_same_model(data_dir, name):
    """Two ranks (q/k norms and Gemma's four norms replicated, Phi-3's split weights sliced after the split,
    a KV head replicated where there is one): prefill logits within float32 rounding of one rank's, the same
    greedy tokens."""
    def engine(tp):
        return LLMEngine(EngineConfig(model=str(data_dir / name), device="cpu", cpu_threads=1, num_kv_blocks=64,
                                      max_num_batched_tokens=64, seed=0, tensor_parallel_size=tp,
                                      collective_timeout_s=30.0))

    one, two = engine(1), engine(2)
    try:
        assert two.executor.world_size == 2
        ids = (REPEATING + SHARED)[:50]
        ref, got = _prefill_logits(one, ids), _prefill_logits(two, ids)
        assert_close_model(got, ref, one.model_config)
        assert (got.argmax(1) == ref.argmax(1)).all()
        # _prefill_logits wrote KV slots the block manager does not know of; requests overwrite before reading.
        for e in (one, two):
            e.add_request("a", SHARED, GREEDY)
        tokens = [drain(e, max_steps=100)["a"].outputs[0].token_ids for e in (one, two)]
        assert tokens[0] == tokens[1]
    finally:
        two.shutdown()
