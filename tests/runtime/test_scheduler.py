"""The scheduler's chunk sizes: by token count, or by cost while decodes wait on the step."""

import random

import pytest

from pagedserve.models.config import ModelConfig
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.core.kv_cache_manager import KVCacheManager
from pagedserve.runtime.core.request import Request
from pagedserve.runtime.sampling_params import SamplingParams
from pagedserve.runtime.core.chunking import chunk_within, keys_per_token
from pagedserve.runtime.core.scheduler import Scheduler

SMOLLM2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 1e4, 8192)
K = SMOLLM2.matmul_flops_per_token / SMOLLM2.attention_flops_per_key


def cost(n: int, context: int, keys_per_token: float) -> float:
    """Token by token: the i-th new token attends to context + i keys (itself included)."""
    return sum(1 + (context + i) / keys_per_token for i in range(1, n + 1))


def test_smollm2_keys_per_token_from_its_flops():
    # 30 layers x (2*576*(576+384) + 2*576*576 + 6*576*1536) = 212.3 MFLOP a token; 4*576*30 per key.
    assert SMOLLM2.matmul_flops_per_token == 212_336_640
    assert SMOLLM2.attention_flops_per_key == 69_120
    assert K == 3072.0 == keys_per_token(SMOLLM2)  # what the engine hands its scheduler
    llama3_8b = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 5e5, 8192)
    assert llama3_8b.matmul_flops_per_token / llama3_8b.attention_flops_per_key == 26624.0


@pytest.mark.parametrize("seed", range(4))
def test_chunk_within_is_the_largest_chunk_that_fits(seed):
    rng = random.Random(seed)
    for _ in range(300):
        budget = rng.randint(1, 4096)
        context = rng.choice([0, rng.randint(0, 200), rng.randint(0, 100_000)])
        remaining = rng.randint(1, 5000)
        k = rng.choice([1.0, 37.5, 288.0, K, 32_768.0, 1e12])
        n = chunk_within(budget, context, remaining, k)
        assert 1 <= n <= remaining
        if n > 1:  # one token always goes, whatever it costs: the prompt must progress
            assert cost(n, context, k) <= budget * (1 + 1e-12)
        if n < remaining:
            assert cost(n + 1, context, k) > budget * (1 - 1e-12)


def test_chunk_within_limits():
    assert chunk_within(240, 0, 4000, float("inf")) == 240  # attention free: the token count
    assert chunk_within(240, 0, 100, K) == 100  # the rest of the prompt fits
    assert chunk_within(5, 10**6, 4000, K) == 1  # one token costs more than the budget: still one
    assert chunk_within(240, 0, 0, K) == 0  # nothing left: nothing
    # bench/jitter.py's chunks: 231 at the start of the 4,000-token prompt, 107 at 3,724 keys.
    assert chunk_within(240, 0, 4000, K) == 231
    assert chunk_within(240, 3724, 276, K) == 107


def _request(rid: str, num_tokens: int) -> Request:
    return Request(rid, [5] * num_tokens, SamplingParams(temperature=0.0, max_tokens=64), 0.0)


def _scheduler(keys_per_token, budget=256):
    return Scheduler(KVCacheManager(1024, 16, False), budget, 64, True, keys_per_token)


def _decoding(sched: Scheduler, num: int) -> list[Request]:
    """`num` requests admitted and past their prompts: their next steps are decodes."""
    rs = [_request(f"d{i}", 8) for i in range(num)]
    for r in rs:
        sched.add_request(r)
    out = sched.schedule()
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(r, 8) for r in rs]
    for r in rs:
        r.num_computed_tokens = 8
        r.all_token_ids.append(9)
    return rs


def _long_prompt_at(sched: Scheduler, computed: int) -> Request:
    """A running prefill of 4,000 tokens with `computed` of them done."""
    r = _request("long", 4000)
    sched.add_request(r)
    sched.schedule()  # admitted
    r.num_computed_tokens = computed
    assert sched.kv.allocate_slots("long", 0, computed)
    return r


@pytest.mark.parametrize("keys_per_token", [K, None])
def test_with_decodes_a_deep_chunk_shrinks_only_when_cost_aware(keys_per_token):
    sched = _scheduler(keys_per_token)
    decodes = _decoding(sched, 16)
    long = _long_prompt_at(sched, 3600)
    out = sched.schedule()
    sizes = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert all(sizes[d.request_id] == 1 for d in decodes)
    expected = chunk_within(240, 3600, 400, K) if keys_per_token else 240
    assert sizes["long"] == expected
    if keys_per_token:
        assert expected < 120  # the chunk's attention costs more than its matmuls here
        assert cost(expected, 3600, K) <= 240 < cost(expected + 1, 3600, K)
    assert long.num_computed_tokens == 3600  # the engine moves it, not the scheduler


def test_without_decodes_a_prefill_takes_the_whole_budget():
    sched = _scheduler(K)
    _long_prompt_at(sched, 3600)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 256)]


def test_an_admission_beside_decodes_is_sized_by_cost_from_its_cached_prefix():
    sched = _scheduler(K)
    _decoding(sched, 4)
    sched.add_request(_request("new", 4000))
    out = sched.schedule()
    sizes = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert sizes["new"] == chunk_within(252, 0, 4000, K) == 242
    assert sum(sizes.values()) <= 256


def test_later_chunks_get_what_the_earlier_chunks_cost_left():
    sched = _scheduler(K)
    _decoding(sched, 16)
    _long_prompt_at(sched, 3950)  # its last 50 tokens cost 50 + 64.7 units
    sched.add_request(_request("new", 4000))
    out = sched.schedule()
    sizes = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    left = 240 - cost(50, 3950, K)
    assert sizes["long"] == 50 and 125 < left < 126
    assert sizes["new"] == chunk_within(125, 0, 4000, K) == 122
    assert 16 + cost(50, 3950, K) + cost(sizes["new"], 0, K) <= 256
    # By count the new prompt would have had 190 tokens: the long one's attention is what it gave up.


def test_a_prefill_that_cannot_fit_a_token_waits_for_the_next_step():
    sched = _scheduler(K)
    _decoding(sched, 16)
    long = _long_prompt_at(sched, 3990)  # one token there costs 1 + 3,991 / 3,072 = 2.3 units
    sched.add_request(_request("new", 100))
    sched.max_num_batched_tokens = 20  # 4 tokens left for prefills beside the 16 decodes
    out = sched.schedule()
    sizes = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert sizes["long"] == 1 and cost(1, 3990, K) > 2
    assert "new" not in sizes and sched.waiting[0].request_id == "new"  # it would cost > 4 - 2.3 units
    assert long.num_computed_tokens == 3990
    sched.max_num_batched_tokens = 18  # 2 left: the long prompt's one token costs more, and still goes
    assert {s.request.request_id: s.num_new_tokens for s in sched.schedule().scheduled}["long"] == 1


def test_scheduler_rejects_a_bad_keys_per_token():
    with pytest.raises(ValueError, match="keys_per_token must be positive or None, got 0"):
        _scheduler(0)


def test_engine_config_checks_the_switch():
    assert EngineConfig().cost_aware_chunking is True
    with pytest.raises(ValueError, match="cost_aware_chunking must be a bool, got 'no'"):
        EngineConfig(cost_aware_chunking="no")



def test_num_batched_tokens_follows_appends_and_replaced_lists():
    """SchedulerOutput counts its tokens incrementally (the scheduler asks after every request): appends, a list
    replaced by a shorter one (a preemption or rollback un-scheduling) and then grown again all give the sum."""
    from pagedserve.runtime.core.scheduler import ScheduledRequest, SchedulerOutput

    reqs = [Request(str(i), [1, 2, 3], SamplingParams(), 0.0) for i in range(5)]
    out = SchedulerOutput()
    assert out.num_batched_tokens == 0
    for i, r in enumerate(reqs):
        out.scheduled.append(ScheduledRequest(r, i + 1))
        assert out.num_batched_tokens == sum(range(1, i + 2))
    out.scheduled = [s for s in out.scheduled if s.request is not reqs[1]]  # un-scheduled: 2 tokens go
    assert out.num_batched_tokens == 15 - 2
    out.scheduled.append(ScheduledRequest(reqs[1], 7))
    assert out.num_batched_tokens == 15 - 2 + 7
    out.scheduled = [ScheduledRequest(reqs[0], 4)] * 6  # a longer new list than the one counted
    assert out.num_batched_tokens == 24
