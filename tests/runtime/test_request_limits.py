"""Limits checked before anything is allocated: each refusal names the field and the limit."""

from __future__ import annotations

import tracemalloc

import pytest

from engine_helpers import drain

from pagedserve.models.loading.loader import load_model
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.engine.llm_engine import LLMEngine
from pagedserve.runtime.engine.request_limits import RequestLimits, kv_blocks_needed
from pagedserve.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(data_dir):
    # 40 blocks of 16 = 640 token slots; max_model_len 256; vocab 512.
    return LLMEngine(EngineConfig(device="cpu", num_kv_blocks=40, max_model_len=256, max_num_seqs=8, seed=0),
                     loaded=load_model(data_dir / "tiny-llama"))


def test_huge_best_of_is_refused_without_allocating(engine):
    """The reported bug: best_of = 2**31 - 1 allocated ~24 GB before anything said no."""
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as err:
            engine.make_request("r", "hello", SamplingParams(n=1, best_of=2**31 - 1, max_tokens=4))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(err.value) == "best_of (2147483647) exceeds max_num_seqs (8)"
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse the request"
    assert not engine.has_unfinished_requests() and engine.kv_manager.usage().num_used_blocks == 0


@pytest.mark.parametrize("prompt,kwargs,message", [
    ([5] * 10, dict(n=9, temperature=1.0), "n (9) exceeds max_num_seqs (8)"),
    ([5] * 10, dict(logprobs=21), "logprobs must be in [0, 20] (max_logprobs), got 21"),
    ([5] * 10, dict(top_k=513), "top_k (513) exceeds the vocabulary size (512)"),
    ([5] * 10, dict(max_tokens=256), "max_tokens (256) plus the prompt exceeds max_model_len (256)"),
    ([5] * 200, dict(max_tokens=57), "prompt (200 tokens) plus max_tokens (57) exceeds max_model_len (256)"),
    ([5] * 256, dict(), "prompt (256 tokens) plus at least one output token exceeds max_model_len (256)"),
    ([5] * 10, dict(stop=["x"] * 65), "stop has 65 strings; the limit is 64"),
    ([5] * 10, dict(stop=["ok", "y" * 1001]), "stop[1] is 1001 characters; the limit is 1000"),
    ([5] * 10, dict(stop_token_ids=[3, 512]), "stop_token_ids must be in [0, 512); got [512]"),
    ([5] * 10, dict(stop_token_ids=[3] * 1025), "stop_token_ids has 1025 ids; the limit is 1024"),
    ([5, 512], dict(), "prompt token ids must be in [0, 512); got [512]"),
    ([5, 1.5], dict(), "prompt token ids must be ints, got 1.5"),
    ([], dict(), "prompt is empty"),
    # 8 samples of a 100-token prompt + 100 tokens: 6 shared blocks + 8 x (13 - 6) = 62 > 40.
    ([5] * 100, dict(n=2, best_of=8, temperature=1.0, max_tokens=100),
     "prompt plus max_tokens for each of 8 samples needs 62 KV blocks but the whole pool has 40"),
])
def test_refusals_name_the_field_and_the_limit(engine, prompt, kwargs, message):
    with pytest.raises(ValueError) as err:
        engine.make_request("r", prompt, SamplingParams(**kwargs))
    assert message in str(err.value)


def test_ids_are_bounded(engine):
    with pytest.raises(ValueError, match="request_id is 257 characters; the limit is 256"):
        engine.make_request("x" * 257, [5], SamplingParams())
    with pytest.raises(ValueError, match="cache_salt is 1025 characters; the limit is 1024"):
        engine.make_request("r", [5], SamplingParams(), cache_salt="s" * 1025)
    with pytest.raises(ValueError, match="request_id must be a non-empty string"):
        engine.make_request("", [5], SamplingParams())


def test_what_fits_exactly_is_accepted_and_runs(engine):
    # 5 samples of a 96-token prompt + 64 tokens: 6 shared + 5 x (10 - 6) = 26 blocks of 40.
    assert kv_blocks_needed(96, 64, 5, 16) == 26
    engine.add_request("fits", [7] * 96, SamplingParams(n=5, temperature=1.0, seed=1, max_tokens=64, ignore_eos=True))
    engine.add_request("top", [7] * 10, SamplingParams(logprobs=20, top_k=512, max_tokens=4, ignore_eos=True))
    done = drain(engine, max_steps=500)
    assert [len(c.token_ids) for c in done["fits"].outputs] == [64] * 5
    assert all(20 <= len(lp) <= 21 for lp in done["top"].outputs[0].logprobs)  # top 20 + the chosen one
    assert engine.kv_manager.usage().num_used_blocks == 0


def test_max_logprobs_is_configurable(data_dir):
    e = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=16, max_logprobs=2),
                  loaded=load_model(data_dir / "tiny-llama"))
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 2\] \(max_logprobs\), got 3"):
        e.make_request("r", [5], SamplingParams(logprobs=3))
    with pytest.raises(ValueError, match="max_logprobs must be a non-negative integer"):
        EngineConfig(max_logprobs=-1)
    with pytest.raises(ValueError, match="max_stop_strings must be a positive integer"):
        RequestLimits(max_stop_strings=0)
