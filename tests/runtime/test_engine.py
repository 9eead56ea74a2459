"""The engine end to end on the tiny committed models: batching, chunking and preemption change nothing."""

from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import drain, make_engine
from pagedserve.runtime.sampling_params import SamplingParams
from pagedserve.runtime.core.chunking import chunk_within


def workload(n=32, seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[1, 300], rng.integers(1, 301, size=n - 2)])
    return [(rng.integers(3, vocab, size=int(n_)).tolist(), int(rng.integers(1, 40))) for n_ in lengths]


def params_for(i, max_tokens, seeded):
    if seeded:
        return SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_batched_chunked_preempted_equals_alone(tiny, seeded):
    reqs = workload()
    alone = []
    for i, (prompt, max_tokens) in enumerate(reqs):
        e = make_engine(tiny, max_num_batched_tokens=2048)
        e.add_request(str(i), prompt, params_for(i, max_tokens, seeded))
        alone.append(drain(e, integrity=False)[str(i)].outputs[0].token_ids)
    # 48 blocks = 768 token slots for 32 requests of up to 340 tokens: preemption is certain.
    e = make_engine(tiny, num_kv_blocks=48, max_num_batched_tokens=64)
    for i, (prompt, max_tokens) in enumerate(reqs):
        e.add_request(str(i), prompt, params_for(i, max_tokens, seeded))
    together = drain(e)
    assert e.num_preemptions > 0, "the pool was meant to be small enough to force preemption"
    for i, (_, max_tokens) in enumerate(reqs):
        got = together[str(i)].outputs[0]
        assert got.token_ids == alone[i], f"request {i}"
        assert len(got.token_ids) == max_tokens and got.finish_reason == "length"
    assert e.kv_manager.usage().num_used_blocks == 0


def test_aborts_mid_flight_free_every_block(tiny):
    e = make_engine(tiny, num_kv_blocks=64)
    for i, (prompt, _) in enumerate(workload(16, seed=1)):
        e.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))

    def abort_some(engine, step):
        if step in (2, 5, 9):
            engine.abort_request([str(i) for i in range(step, 16, 3)])

    finished = drain(e, on_step=abort_some)
    assert len(finished) < 16
    assert e.kv_manager.usage().num_used_blocks == 0 and not e.has_unfinished_requests()


def test_decodes_get_a_token_every_step_during_a_long_chunked_prefill(tiny):
    e = make_engine(tiny, max_num_batched_tokens=128, num_kv_blocks=512)
    for i in range(4):
        e.add_request(f"d{i}", [5 + i, 6, 7], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    e.step()  # the four short prompts prefill together
    e.add_request("long", list(np.random.default_rng(3).integers(3, 512, size=2000)),
                  SamplingParams(temperature=0, max_tokens=1))
    chunks = 0
    for _ in range(2000):  # at least one prompt token a step
        if "long" not in e.groups or e.groups["long"].seqs[0].num_output_tokens:
            break
        outs = {o.request_id for o in e.step()}
        assert {f"d{i}" for i in range(4)} <= outs, "a running decode missed a step"
        chunks += 1
    else:
        pytest.fail("the 2,000-token prompt was not prefilled within 2,000 steps")
    assert chunks >= 2000 // 128  # the prompt really was cut into chunks


def _long_prompt_beside_decodes(e):
    """Four streams decode while a 2,000-token prompt prefills: (the steps its prefill took, every token)."""
    for i in range(4):
        e.add_request(f"d{i}", [5 + i, 6, 7], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    e.step()
    e.add_request("long", list(np.random.default_rng(3).integers(3, 512, size=2000)),
                  SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    steps = 0
    for _ in range(2000):
        if e.groups["long"].seqs[0].num_output_tokens:
            break
        e.step()
        steps += 1
    else:
        pytest.fail("the 2,000-token prompt was not prefilled within 2,000 steps")
    finished = drain(e)
    return steps, {rid: out.outputs[0].token_ids for rid, out in finished.items()}


def test_cost_aware_chunks_shrink_deep_in_a_prompt_and_change_no_token(tiny):
    cfg = tiny.config
    engine = make_engine(tiny, max_num_batched_tokens=128)
    keys_per_token = engine.scheduler.keys_per_token
    # the model's FLOP ratio over the kernel set's attention cost (KernelSet.attention_cost)
    flops_ratio = cfg.matmul_flops_per_token / cfg.attention_flops_per_key
    assert keys_per_token == flops_ratio / engine.backend.ops.attention_cost
    assert keys_per_token < 1000  # the tiny model's attention outweighs its matmuls within the prompt
    by_cost, tokens = _long_prompt_beside_decodes(engine)
    by_count, tokens_by_count = _long_prompt_beside_decodes(
        make_engine(tiny, max_num_batched_tokens=128, cost_aware_chunking=False))
    assert by_count == -(-2000 // 124)  # 124 prompt tokens a step beside the 4 decodes
    expected, done = 0, 0
    for _ in range(2000):
        if done >= 2000:
            break
        chunk = chunk_within(124, done, 2000 - done, keys_per_token)
        assert chunk >= 1, f"chunk_within gave {chunk} tokens at {done}"
        done += chunk
        expected += 1
    # the streams decode through the whole prefill (120 tokens each), so every chunk was sized by cost
    assert by_cost == expected > by_count, (by_cost, expected, by_count)
    assert tokens == tokens_by_count and len(tokens) == 5


def test_admission_errors_are_precise_and_leave_nothing_behind(tiny):
    e = make_engine(tiny, max_model_len=256, num_kv_blocks=8)
    with pytest.raises(ValueError, match=r"prompt \(250 tokens\) plus max_tokens \(10\) exceeds max_model_len \(256\)"):
        e.add_request("a", [5] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="needs 10 KV blocks but the whole pool has 8"):
        e.add_request("b", [5] * 150, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="prompt is empty"):
        e.add_request("c", [], SamplingParams())
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        e.add_request("d", [5, 512], SamplingParams())
    e.add_request("ok", [5, 6], SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(ValueError, match="already in use"):
        e.add_request("ok", [5, 6], SamplingParams())
    assert len(drain(e)) == 1 and e.kv_manager.usage().num_used_blocks == 0


def test_stop_conditions(tiny):
    e = make_engine(tiny)
    base = list(range(10, 30))
    e.add_request("ref", base, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ref = drain(e)["ref"].outputs[0]
    ids, text = ref.token_ids, ref.text
    # stop_token_ids: ends at the first occurrence, reported as the stop reason
    e.add_request("tok", base, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ids[4]], ignore_eos=True))
    got = drain(e)["tok"].outputs[0]
    first = ids.index(ids[4])
    assert got.token_ids == ids[: first + 1] and got.finish_reason == "stop" and got.stop_reason == ids[4]
    # min_tokens bans the stop token until enough tokens are out
    e.add_request("min", base, SamplingParams(temperature=0, max_tokens=12, min_tokens=12,
                                              stop_token_ids=[ids[0]], ignore_eos=True))
    got = drain(e)["min"].outputs[0]
    assert len(got.token_ids) == 12 and ids[0] not in got.token_ids
    # a stop string is left out of the text
    # (the first two-character piece from the middle on that is not blank; the reference has one)
    starts = [i for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].strip()]
    assert starts, f"the reference output has no stop string to test with: {text!r}"
    stop = text[starts[0] : starts[0] + 2]
    e.add_request("str", base, SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True))
    got = drain(e)["str"].outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.text == text[: text.index(stop)]
    assert e.kv_manager.usage().num_used_blocks == 0


def test_stats_and_timings(tiny):
    e = make_engine(tiny, num_kv_blocks=100)
    e.add_request("a", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    e.step()
    s = e.get_stats()
    assert s.num_running == 1 and s.num_waiting == 0 and s.num_kv_blocks_total == 100
    assert s.num_kv_blocks_used == 3 and 0 < s.kv_token_slot_utilization <= 1
    out = drain(e)["a"]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert out.outputs[0].finish_reason == "length"
