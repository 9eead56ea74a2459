"""Property test: any mix of shared-prefix, n > 1 and beam requests, with aborts and a pool small
enough to preempt, keeps the block pool consistent after every step and ends with nothing in use."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pagedserve.runtime.core.beam_search import BeamSearchParams
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.engine.llm_engine import LLMEngine
from pagedserve.runtime.sampling_params import SamplingParams


PREFIXES = [[7] * 40, list(range(3, 60)), [9, 8, 7] * 11]

request_st = st.fixed_dictionaries({
    "kind": st.sampled_from(["plain", "n", "beam"]),
    "prefix": st.integers(0, len(PREFIXES) - 1),
    "suffix": st.lists(st.integers(3, 500), min_size=1, max_size=20),
    "n": st.integers(2, 4),
    "max_tokens": st.integers(1, 12),
    "seed": st.integers(0, 1000),
    "arrive": st.integers(0, 6),
    "abort_at": st.one_of(st.none(), st.integers(0, 15)),
})


@settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate], suppress_health_check=[HealthCheck.function_scoped_fixture])  # noqa: E501
@given(requests=st.lists(request_st, min_size=1, max_size=10), num_blocks=st.integers(12, 40),
       budget=st.sampled_from([16, 48, 256]))
def test_random_mixes_keep_integrity_and_free_everything(tiny, requests, num_blocks, budget):
    e = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=num_blocks, max_num_batched_tokens=budget, seed=0,
                               max_model_len=512), loaded=tiny)
    added = []
    for step in range(200):
        for i, r in enumerate(requests):
            if r["arrive"] == step:
                prompt = PREFIXES[r["prefix"]] + r["suffix"]
                try:
                    if r["kind"] == "beam":
                        e.add_beam_request(str(i), prompt, BeamSearchParams(beam_width=r["n"], max_tokens=r["max_tokens"]))  # noqa: E501
                    else:
                        n = r["n"] if r["kind"] == "n" else 1
                        e.add_request(str(i), prompt, SamplingParams(n=n, temperature=0.8, seed=r["seed"],
                                                                     max_tokens=r["max_tokens"]))
                    added.append(i)
                except ValueError as err:  # a prompt that could never fit this tiny pool is refused
                    assert "KV blocks" in str(err)
            if r["abort_at"] == step and i in added:
                e.abort_request(str(i))
        if not e.has_unfinished_requests() and step > 6:
            break
        e.step()
        e.check_integrity()
    assert not e.has_unfinished_requests()
    usage = e.kv_manager.usage()
    assert usage.num_used_blocks == 0 and usage.num_free_blocks == num_blocks
