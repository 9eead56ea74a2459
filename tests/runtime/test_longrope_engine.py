"""LongRoPE through the engine (tiny-phi3: pretraining length M = 64, long factors past it; models/rope.py).

A prompt past M cut into chunks that end within M keeps the tokens of its one-chunk run and of transformers (the
golden's greedy run: a full forward per token); the prefix cache never hands a short prompt keys a long one rotated
with the long factors, or the reverse (runtime/core/prefix_caching.py: prefix_key); a speculative verify step
across M keeps the plain run's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import InlineConnector, drain, make_engine, tiny_loaded

from pagedserve.runtime.core.kv_cache_manager import KVCacheManager
from pagedserve.runtime.sampling_params import SamplingParams

M = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
RNG = np.random.default_rng(35)
SHARED = RNG.integers(3, 512, size=32).tolist()  # two full blocks of 16
LONG = SHARED + RNG.integers(3, 512, size=68).tolist()  # 100 tokens: past M
SHORT = SHARED + RNG.integers(3, 512, size=8).tolist()  # 40 tokens: within M (40 + 16 generated stay within)


@pytest.fixture(scope="module")
def phi3():
    loaded = tiny_loaded("tiny-phi3")
    assert loaded.config.rope_scaling["original_max_position_embeddings"] == M
    return loaded


def _run(loaded, prompts: dict, **overrides) -> dict:
    engine = make_engine(loaded, block_size=16, **overrides)
    for rid, (ids, params) in prompts.items():
        engine.add_request(rid, ids, params)
    return drain(engine, max_steps=500)


def test_chunked_long_prompt_keeps_the_unchunked_and_oracle_tokens(phi3, data_dir):
    """The golden's 120-token prompt in chunks of 16 (four of them end within M) and in one chunk: the same
    32 greedy tokens as transformers' (all long), and the same log-probabilities up to float32 rounding."""
    g = np.load(data_dir / "goldens" / "tiny-phi3.npz")
    prompt, oracle = g["prompt_ids_3"].tolist(), g["greedy_ids_3"].tolist()
    assert len(prompt) == 120 > M
    params = SamplingParams(temperature=0.0, max_tokens=len(oracle), ignore_eos=True, logprobs=0)
    whole = _run(phi3, {"p": (prompt, params)}, max_num_batched_tokens=256)["p"].outputs[0]
    chunked = _run(phi3, {"p": (prompt, params)}, max_num_batched_tokens=16)["p"].outputs[0]
    assert whole.token_ids == oracle
    assert chunked.token_ids == oracle
    np.testing.assert_allclose(chunked.cumulative_logprob, whole.cumulative_logprob, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("order", [("long", "short"), ("short", "long")])
def test_prefix_cache_keeps_short_and_long_prompts_apart(phi3, order):
    """A long prompt then a short one sharing its first two blocks (and the reverse): the second misses the cache
    and gets the tokens of a cache-off engine. Hashed without the flag it would hit, and its tokens change."""
    prompts = {"long": (LONG, GREEDY), "short": (SHORT, GREEDY)}
    cold = {rid: _run(phi3, {rid: prompts[rid]}, enable_prefix_caching=False)[rid].outputs[0].token_ids
            for rid in prompts}
    for flagged in (True, False):
        engine = make_engine(phi3, block_size=16, enable_prefix_caching=True)
        if not flagged:
            engine.kv_manager.long_prompt_threshold = None  # the hashes of a model without LongRoPE
        first, second = order
        engine.add_request(first, *prompts[first])
        assert drain(engine, max_steps=500)[first].outputs[0].token_ids == cold[first]
        engine.add_request(second, *prompts[second])
        out = drain(engine, max_steps=500)[second]
        if flagged:
            assert out.num_cached_tokens == 0
            assert out.outputs[0].token_ids == cold[second]
        else:  # the scenario is one the flag decides: keys rotated with the other factors change the tokens
            assert out.num_cached_tokens == 32
            assert out.outputs[0].token_ids != cold[second]


def test_prefix_cache_still_hits_within_one_factor_set(phi3):
    """Two long prompts sharing 96 tokens, and two short ones sharing 32, hit as usual with cache-off tokens."""
    long2 = LONG[:96] + [7, 8, 9, 10, 11]
    short2 = SHARED + [12, 13, 14]
    prompts = {"long": (LONG, GREEDY), "long2": (long2, GREEDY), "short": (SHORT, GREEDY), "short2": (short2, GREEDY)}
    cold = _run(phi3, prompts, enable_prefix_caching=False)
    engine = make_engine(phi3, block_size=16, enable_prefix_caching=True)
    for rid in ("long", "short"):
        engine.add_request(rid, *prompts[rid])
    drain(engine, max_steps=500)
    for rid in ("long2", "short2"):
        engine.add_request(rid, *prompts[rid])
    warm = drain(engine, max_steps=500)
    assert (warm["long2"].num_cached_tokens, warm["short2"].num_cached_tokens) == (96, 32)
    for rid in ("long2", "short2"):
        assert warm[rid].outputs[0].token_ids == cold[rid].outputs[0].token_ids


def test_prefix_key_is_the_salt_alone_without_longrope():
    plain = KVCacheManager(8, 4, enable_prefix_caching=True)
    assert plain.prefix_key("tenant", 10_000) == "tenant" and plain.prefix_key(None, 3) is None
    longrope = KVCacheManager(8, 4, enable_prefix_caching=True, long_prompt_threshold=M)
    assert longrope.prefix_key("tenant", M) == ("tenant", False)
    assert longrope.prefix_key("tenant", M + 1) == ("tenant", True)


def test_speculative_verify_across_the_threshold_keeps_the_plain_tokens(phi3):
    """A 56-token repeating prompt generating 24 tokens crosses M; n-gram drafts verified in steps that straddle it
    rotate each token as the plain one-token decodes do, so the greedy tokens are the same."""
    prompt = [11, 12, 13, 14, 15, 16, 17, 18] * 7
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = _run(phi3, {"p": (prompt, params)})["p"].outputs[0].token_ids
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
             "min_acceptance_rate": 0.0}
    engine = make_engine(phi3, block_size=16, speculative_config=ngram)
    engine.add_request("p", prompt, params)
    assert drain(engine, max_steps=200)["p"].outputs[0].token_ids == plain
    assert engine.spec.stats.num_draft_tokens > 0


def test_remote_prefill_sends_only_blocks_rotated_as_the_whole_prompt(phi3):
    """Disaggregated prefill: the prefill instance computes the decode side's full blocks as a prompt of their own.
    For 100 and 40 tokens (96 and 32 sent) that prompt takes the whole one's factors and the blocks go remote; for
    70 (64 sent, within M, while 70 is past it) they would come back rotated short, so it is prefilled locally."""
    prompts = {"p100": LONG, "p40": SHORT, "p70": LONG[:70]}
    colocated = {rid: out.outputs[0].token_ids for rid, out in
                 _run(phi3, {rid: (ids, GREEDY) for rid, ids in prompts.items()}).items()}
    decode = make_engine(phi3, block_size=16)
    conn = InlineConnector(make_engine(phi3, block_size=16))
    decode.enable_remote_prefill(conn)
    for rid, ids in prompts.items():
        decode.add_request(rid, ids, GREEDY)
    got = {rid: out.outputs[0].token_ids for rid, out in drain(decode, max_steps=500).items()}
    assert got == colocated
    assert sorted(len(s.token_ids) for s in conn.specs) == [32, 96]
    assert decode.kv_stats.remote_prefills == 2 and decode.kv_stats.local_prefill_fallbacks == 1
