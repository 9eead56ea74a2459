"""The speculation policy's decisions, with step costs and acceptance injected (no timing)."""

from __future__ import annotations

import pytest

from pagedserve.runtime.spec_decode.config import SpeculativeConfig
from pagedserve.runtime.spec_decode.policy import Candidate, SpecPolicy, StepCosts, expected_gain


def policy(*, shadow=True, gpu=False, k=4, k_max=12, probe=16, min_rate=None) -> SpecPolicy:
    return SpecPolicy(k, k_max, probe, min_rate, gpu, shadow)


def cpu_costs(p: SpecPolicy, decode_s=0.023, verify_s=0.066, per_row=0.001) -> None:
    """A CPU-like engine: one row 23 ms, any 2+ rows a GEMM at ~66 ms, plus 1 ms a row."""
    p.observe_step(1, decode_s)
    for rows in (2, 5, 9, 13, 40):
        p.observe_step(rows, verify_s + per_row * rows)


def learned(p: SpecPolicy, accepted: int, tried: int):
    rec = p.new_record()
    p._learn(rec, accepted, tried)
    return rec


def chosen(p: SpecPolicy, cands, num_decoding):
    return [c.key for c in p.choose(cands, num_decoding)]


def test_single_stream_speculates_only_when_expected_tokens_beat_the_measured_cost_ratio():
    p = policy()
    cpu_costs(p)
    assert p.costs.ratio(5, 1) == pytest.approx(71 / 23)  # ~3.1 decode steps per verify step
    good = learned(p, 40, 41)  # copying: ~0.97 per draft
    assert 1 + expected_gain(p.acceptance_rate(good), 4) > p.costs.ratio(5, 1)
    assert chosen(p, [Candidate("copy", good, 4)], 1) == ["copy"]
    q = policy()
    cpu_costs(q)
    middling = learned(q, 6, 10)  # 0.6 per draft: 1 + 1.3 expected tokens, less than 3.1 steps' cost
    assert chosen(q, [Candidate("chat", middling, 4)], 1) == []


def test_the_same_acceptance_pays_in_a_big_batch_where_extra_rows_are_cheap():
    p = policy()
    cpu_costs(p)
    p.observe_step(8, 0.070)  # 8 decodes already make a GEMM: 4 more rows cost ~1 ms, not 2 decode steps
    p.observe_step(12, 0.071)
    rec = learned(p, 6, 10)
    assert chosen(p, [Candidate("one", rec, 4)], 1) == []
    assert chosen(p, [Candidate("one", rec, 4)], 8) == ["one"]


def test_in_a_batch_the_best_drafts_go_first_and_hopeless_ones_stay_out():
    p = policy()
    cpu_costs(p)
    p.observe_step(8, 0.070)
    p.observe_step(16, 0.078)
    p.observe_step(24, 0.200)  # past 16 rows this engine's steps get dear (made up, to cut the prefix)
    good, bad = learned(p, 40, 41), learned(p, 0, 20)
    cands = [Candidate("bad", bad, 8), Candidate("good", good, 8), Candidate("good2", good, 8)]
    assert chosen(p, cands, 8) == ["good"]  # 8 + 8 rows: ~1.1x the cost for ~7 more tokens; 24 rows lose


def test_an_engine_learns_that_lookups_fail_so_new_sequences_do_not_each_pay_for_it():
    p = policy()  # the CPU prior's costs: a verify step of 5 rows ~2.7 decode steps
    fresh = p.new_record()
    assert chosen(p, [Candidate("first", fresh, 4)], 1) == []  # nothing of its own checked yet: shadow first
    p._learn(fresh, 1, 1)  # its first proposal's first token came true (checked unverified)
    assert chosen(p, [Candidate("first", fresh, 4)], 1) == ["first"]  # with the prior acceptance: worth a try
    for _ in range(3):  # three sequences' verify steps that accept nothing
        p.observe_verify(p.new_record(), 4, 0)
    assert p.acceptance_rate(p.new_record()) < 0.5
    assert chosen(p, [Candidate("new", learned(p, 1, 1), 4)], 1) == []  # one lucky token no longer pays for it


def test_ngram_proposals_are_checked_unverified_and_speculation_comes_back_when_they_come_true():
    p = policy()
    cpu_costs(p)
    rec = learned(p, 0, 6)  # off: its last drafts all failed
    cand = Candidate("seq", rec, 4)
    assert chosen(p, [cand], 1) == []
    tokens = [5, 6, 7, 8]
    p.declined(rec)
    p.set_shadow(rec, [9, 10, 11, 12], len(tokens))  # the lookup's proposal, not verified
    for t in (9, 10, 11):  # the sequence then generates exactly what the lookup proposed
        tokens.append(t)
        p.catch_up(rec, tokens)
    assert rec.acceptance.accepted == pytest.approx(1 + 0.85 + 0.85 ** 2)  # counted once each, older ones decayed
    assert p.num_shadow_checked == 3
    p.catch_up(rec, tokens)  # no new token: nothing counted twice
    assert p.num_shadow_checked == 3
    tokens.append(99)  # the fourth draft was wrong: one failure, and the shadow is done
    p.catch_up(rec, tokens)
    assert rec.shadow is None and p.num_shadow_checked == 4
    assert rec.acceptance.accepted < rec.acceptance.tried
    for _ in range(3):
        p.set_shadow(rec, [1, 2, 3, 4], len(tokens))
        tokens += [1, 2, 3, 4]
        p.catch_up(rec, tokens)
    assert chosen(p, [cand], 1) == ["seq"]


def test_a_draft_model_has_no_shadow_and_probes_with_a_doubling_wait_stretched_by_its_cost():
    p = policy(shadow=False, k_max=4)
    p.observe_step(1, 0.020)
    p.observe_step(5, 0.024)  # a GPU-like target and a cheap draft: a probe costs 0.3 decode steps more
    p.observe_drafting(4, 0.002)
    rec = learned(p, 0, 8)
    p.set_shadow(rec, [1, 2], 10)
    assert rec.shadow is None  # drafting costs compute: nothing is proposed unverified
    cand = Candidate("seq", rec, 4)

    def steps_until_probe():
        for n in range(1, 500):
            if chosen(p, [cand], 1):
                return n
            p.declined(rec)
        raise AssertionError("never probed")

    assert steps_until_probe() == 16
    p.observe_verify(rec, 4, 0)  # the probe failed: wait twice as long
    assert steps_until_probe() == 32
    p.observe_verify(rec, 4, 0)
    assert steps_until_probe() == 64
    p.observe_verify(rec, 4, 3)  # a probe that pays resets the wait
    assert rec.backoff == 0
    p = policy(shadow=False, k_max=4)  # a dearer draft: 10 ms a draft step
    p.observe_step(1, 0.020)
    p.observe_step(5, 0.024)
    p.observe_drafting(4, 0.040)
    rec = learned(p, 0, 8)
    cand = Candidate("seq2", rec, 4)
    assert steps_until_probe() == 36  # a try costs 2.2 decode steps more: 16 * 2.2 = 35.2, the 36th step


def test_k_doubles_after_full_acceptance_up_to_the_cap_and_halves_after_a_rejection():
    p = policy(k=4, k_max=12)
    rec = p.new_record()
    p.observe_verify(rec, 4, 4)
    assert rec.k == 8
    p.observe_verify(rec, 3, 3)  # fewer drafts than k (the lookup found 3): no growth
    assert rec.k == 8
    p.observe_verify(rec, 8, 8)
    assert rec.k == 12
    p.observe_verify(rec, 12, 12)
    assert rec.k == 12
    p.observe_verify(rec, 12, 5)
    assert rec.k == 6
    p.observe_verify(rec, 6, 0)
    assert rec.k == 4  # never below num_speculative_tokens


def test_min_acceptance_rate_zero_always_speculates_and_a_threshold_replaces_the_cost_rule():
    p = policy(min_rate=0.0)
    cpu_costs(p)
    assert chosen(p, [Candidate("a", learned(p, 0, 50), 4)], 1) == ["a"]
    q = policy(min_rate=0.5)
    assert chosen(q, [Candidate("lo", learned(q, 1, 10), 4), Candidate("hi", learned(q, 9, 10), 4)], 1) == ["hi"]


def test_on_a_gpu_prior_drafts_pay_from_the_start():
    p = policy(gpu=True)
    assert p.costs.ratio(5, 1) < 1.2
    assert chosen(p, [Candidate("a", p.new_record(), 4)], 1) == ["a"]


def test_step_costs_use_the_nearest_measurement_scaled_by_the_prior_shape_and_clip_stalls():
    c = StepCosts((1.0, 0.1))
    assert c.ratio(5, 1) == pytest.approx((1 + 1.0 + 0.4) / 1)  # nothing measured: the prior
    c.observe(1, 0.02)
    c.observe(5, 0.05)
    assert c.estimate(6) == pytest.approx(0.05 * 2.5 / 2.4)
    c.observe(1, 10.0)  # another process took the core for a while: a bounded move
    assert c.estimate(1) == pytest.approx(0.02 + 0.25 * (0.06 - 0.02))


def test_max_num_speculative_tokens_defaults_and_validation():
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=4).max_num_speculative_tokens == 12
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=8).max_num_speculative_tokens == 16
    assert SpeculativeConfig(method="draft", draft_num_layers=1).max_num_speculative_tokens == 4
    with pytest.raises(ValueError, match="max_num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=4, max_num_speculative_tokens=2)
    with pytest.raises(ValueError, match="max_num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=4, max_num_speculative_tokens=17)
    assert SpeculativeConfig.from_value({"method": "ngram", "min_acceptance_rate": None}).min_acceptance_rate is None


def test_a_draft_models_own_time_counts_against_its_drafts():
    def engine(drafting_s=None):
        p = policy(shadow=False, k_max=4)
        p.observe_step(1, 0.020)
        p.observe_step(5, 0.024)  # a GPU-like target: 4 more rows nearly free
        if drafting_s is not None:
            p.observe_drafting(4, drafting_s)
        return p, Candidate("a", learned(p, 6, 10), 4)

    p, cand = engine(0.004)  # 1 ms a draft step
    assert chosen(p, [cand], 1) == ["a"]
    p, cand = engine(0.040)  # 10 ms a draft step: 1.6 expected tokens do not pay 3.2 steps
    assert chosen(p, [cand], 1) == []
    p, cand = engine()  # not timed yet: half a target step per draft step, 2.2 steps for 1.6 tokens
    assert chosen(p, [cand], 1) == []


def test_no_probe_where_even_drafts_all_accepted_could_not_pay():
    p = policy(shadow=False, k_max=2, k=2)
    p.observe_step(1, 0.020)
    p.observe_step(3, 0.060)  # a CPU-like target: 2 more rows cost 2 decode steps
    p.observe_drafting(2, 0.020)  # and 2 draft steps one more: 3 tokens at best for 4 steps' time
    cand = Candidate("seq", learned(p, 0, 8), 2)
    for _ in range(1000):
        assert chosen(p, [cand], 1) == []
        p.declined(cand.record)
