"""n > 1 at temperature 0: ONE greedy sequence runs, its output copied to choices 0..n-1 (never n greedy runs)."""

from __future__ import annotations

from engine_helpers import drain, make_engine

from pagedserve.runtime import LLM, SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, **kw)


def test_greedy_n_runs_one_sequence_and_returns_n_identical_choices():
    engine = make_engine()
    engine.add_request("one", PROMPT, _greedy())
    single = drain(engine)["one"].outputs
    engine.add_request("copies", PROMPT, _greedy(n=3))
    outs = engine.step()  # the prompt's prefill: a sampled request would fork its other samples here
    group = engine.groups["copies"]
    assert len(group.seqs) == 1 and group.num_to_fork == 0  # one sequence holds KV, not three
    blocks_one = engine.kv_manager.usage().num_used_blocks
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for _ in range(100):
        assert engine.kv_manager.usage().num_used_blocks <= blocks_one + 1  # one sequence's growth
        for out in outs:
            for c in out.outputs:
                streamed[c.index] += c.new_token_ids
            if out.finished:
                final = out.outputs
        if not engine.has_unfinished_requests():
            break
        outs = engine.step()
    assert [c.index for c in final] == [0, 1, 2]
    for c in final:
        assert c.token_ids == single[0].token_ids and c.text == single[0].text
        assert c.logprobs == single[0].logprobs and c.finish_reason == single[0].finish_reason == "length"
        assert c.cumulative_logprob == single[0].cumulative_logprob
    assert final[0].token_ids is not final[1].token_ids  # copies, not one list shared by every choice
    assert all(ids == single[0].token_ids for ids in streamed.values())  # each choice streamed it whole
    assert engine.kv_manager.usage().num_used_blocks == 0


def test_greedy_best_of_is_one_run_too():
    engine = make_engine()
    engine.add_request("b", PROMPT, _greedy(n=2, best_of=4))
    assert engine.groups["b"].num_to_fork == 0
    out = drain(engine)["b"].outputs
    assert [c.index for c in out] == [0, 1] and out[0].token_ids == out[1].token_ids and len(out[0].token_ids) == 12


def test_llm_generate_greedy_n(data_dir):
    llm = LLM(str(data_dir / "tiny-llama"), device="cpu", num_kv_blocks=64, seed=0)
    one, many = llm.generate([PROMPT, PROMPT], [_greedy(), _greedy(n=4)])
    assert len(many.outputs) == 4 and [c.index for c in many.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == one.outputs[0].token_ids and c.text == one.outputs[0].text for c in many.outputs)


def test_sampled_n_still_forks_its_samples():
    engine = make_engine()
    engine.add_request("s", PROMPT, SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=8, ignore_eos=True))
    assert engine.groups["s"].num_to_fork == 2
    out = drain(engine)["s"].outputs
    assert [c.index for c in out] == [0, 1, 2] and len({tuple(c.token_ids) for c in out}) > 1
