"""Speculative decoding of guided sequences: drafts checked against the grammar, verify rows masked by the
state after the drafts before them, the matcher advanced by accepted tokens only (runtime/spec_decode/grammar.py).

On the tiny random-weight model the grammar's mask alone keeps outputs in the language, so a verify row
without the right mask would show at once (a refused token raises, or greedy tokens differ)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import engine_helpers
from engine_helpers import drain

from pagedserve.runtime.core.beam_search import BeamSearchParams
from pagedserve.runtime.sampling_params import SamplingParams
from pagedserve.runtime.spec_decode.grammar import DraftGuide, guided_ngram_drafts
from pagedserve.runtime.structured_outputs_params import StructuredOutputsParams as SO

DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
         "min_acceptance_rate": 0.0}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 16,
          "suffix_decoding_max_cached_requests": 4, "min_acceptance_rate": 0.0}
# A fragment the prompt repeats and the regex asks for again: prompt lookup finds it, the target takes it.
ECHO_TEXT = "id=ab12-cd34; id=ab12-cd34; id="
ECHO = r"ab12-cd34; id=ab12-cd34"


def specs(data_dir):
    return {
        "ngram": NGRAM,
        "suffix": SUFFIX,
        "self_draft": {"method": "draft", "draft_num_layers": 1, "num_speculative_tokens": 3,
                       "min_acceptance_rate": 0.0},
        # The target as its own draft: masked the same way, every guided draft must be accepted.
        "same_draft": {"model": str(data_dir / "tiny-llama"), "num_speculative_tokens": 5, "min_acceptance_rate": 0.0},
    }


def make_engine(tiny, spec=None, **kw):
    return engine_helpers.make_engine(tiny, speculative_config=spec, **kw)


run_all = drain  # checks both pools (the engine's and a draft model's) after every step, and for leaks at the end


def guided_workload(tok):
    """Guided requests (JSON schema, regex; greedy, or n = 2 at top_k = 1), prompts that repeat themselves
    (prompt lookup finds drafts), the echo request and one unguided request."""
    rng = np.random.default_rng(5)
    reqs = []
    for i in range(8):
        base = rng.integers(3, 512, size=int(rng.integers(4, 24))).tolist()
        so = SO(json=SCHEMA) if i % 2 else SO(regex=DATE)
        # n = 2 samples at top_k = 1: the random path (dense p, residual draws), with one token possible.
        params = SamplingParams(n=2, temperature=1.0, top_k=1, seed=i, max_tokens=30, structured_outputs=so) \
            if i % 3 == 0 else SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=so)
        reqs.append((f"g{i}", base * 3, params))
    reqs.append(("echo", tok.encode(ECHO_TEXT), SamplingParams(temperature=0.0, max_tokens=40,
                                                               structured_outputs=SO(regex=ECHO))))
    reqs.append(("plain", rng.integers(3, 512, size=12).tolist() * 2,
                 SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))
    return reqs


def outputs(engine, reqs):
    for rid, prompt, params in reqs:
        group = engine.add_request(rid, prompt, params)
        if group.grammar is not None:
            group.grammar.result()  # compiled before the first step: the same schedule every run
    done = run_all(engine)
    return {rid: [(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for rid, o in done.items()}


SMALL = dict(num_kv_blocks=9, max_num_batched_tokens=32)  # preemption certain, prefill chunked


@pytest.fixture(scope="module")
def baseline(tiny):
    engine = make_engine(tiny, **SMALL)
    out = outputs(engine, guided_workload(tiny.tokenizer))
    assert engine.num_preemptions > 0, "the pool was meant to be small enough to force preemption"
    return out


@pytest.mark.parametrize("method", ["ngram", "suffix", "self_draft", "same_draft"])
def test_greedy_guided_output_is_the_same_with_speculation(tiny, data_dir, baseline, method):
    e = make_engine(tiny, specs(data_dir)[method], **SMALL)
    got = outputs(e, guided_workload(tiny.tokenizer))
    assert e.num_preemptions > 0
    assert got == baseline
    for rid, samples in got.items():
        for _, text, reason in samples:
            if rid == "plain":
                continue
            assert reason == "stop", (rid, text)
            if rid == "echo":
                assert re.fullmatch(ECHO, text)
            elif int(rid[1:]) % 2:
                assert set(json.loads(text)) == {"ok", "n"}
            else:
                assert re.fullmatch(DATE, text)
    stats = e.spec.stats
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    es = e.get_stats()
    assert (es.spec_num_draft_tokens, es.spec_num_accepted_tokens) == (stats.num_draft_tokens,
                                                                      stats.num_accepted_tokens)
    assert es.spec_mean_accepted_length == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts)


def test_guided_ngram_drafts_are_accepted(tiny):
    """The regex repeats a fragment of the prompt: prompt lookup proposes it and the target accepts it."""
    e = make_engine(tiny, NGRAM)
    e.add_request("echo", tiny.tokenizer.encode(ECHO_TEXT), SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=SO(regex=ECHO)))
    out = run_all(e)["echo"].outputs[0]
    assert re.fullmatch(ECHO, out.text) and out.finish_reason == "stop"
    stats = e.spec.stats
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0
    assert stats.num_accepted_tokens >= len(out.token_ids) // 2  # most tokens came as accepted drafts


def test_same_draft_accepts_every_guided_draft_and_stops_inside_a_run(tiny, data_dir):
    """The target as its own draft, both masked by the same grammar states: every draft is accepted, so the
    verify rows' masks are exactly those the draft drew under; the grammar completes inside a run of
    accepted drafts and nothing after the completing token is emitted."""
    e = make_engine(tiny, specs(data_dir)["same_draft"])
    plain = make_engine(tiny)
    for engine in (e, plain):
        engine.add_request("d", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=40,
                                                          structured_outputs=SO(regex=DATE)))
    got, want = run_all(e)["d"].outputs[0], run_all(plain)["d"].outputs[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    assert re.fullmatch(DATE, got.text)
    stats = e.spec.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    # The first token came from the prefill, then each verify step gave its drafts and the target's own
    # token, except the last: its last draft completed the grammar and the token after it was dropped.
    assert len(got.token_ids) == 1 + stats.num_accepted_tokens + stats.num_drafts - 1


def test_drafts_are_cut_before_the_first_token_the_grammar_refuses(tiny):
    e = make_engine(tiny, NGRAM)
    tok = tiny.tokenizer
    group = e.add_request("d", tok.encode("1999-12-31 1999-12-31 1999"), SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=SO(regex=r"-12-31")))
    r = group.seqs[0]
    free = guided_ngram_drafts(None, r, 8, 1, 4)
    assert tok.decode(free) == "-12-31 19"  # prompt lookup alone goes on past the date
    drafts = guided_ngram_drafts(e.structured, r, 8, 1, 4)
    assert drafts == free[: len(drafts)] and tok.decode(drafts) == "-12-31"  # the grammar takes no more
    assert e.structured.num_valid_drafts(r, free) == len(drafts)  # validating left the matcher where it was
    out = run_all(e)["d"].outputs[0]
    assert out.text == "-12-31" and out.finish_reason == "stop"


def test_verify_rows_get_the_masks_after_each_draft_and_the_matcher_is_unchanged(tiny):
    e = make_engine(tiny)
    tok = tiny.tokenizer
    r = e.add_request("d", [5, 6], SamplingParams(temperature=0.0, max_tokens=20,
                                                  structured_outputs=SO(regex=DATE))).seqs[0]
    drafts = tok.encode("2024-0", add_special_tokens=False)
    m = e.structured.matcher(r)
    bitmask = e.structured.start_bitmask([r, r], [[], drafts]).result()
    assert bitmask.rows.tolist() == list(range(2 + len(drafts)))
    step = m.deep_copy()
    for j in range(len(drafts) + 1):  # row 1 + j: the state after the first j drafts
        np.testing.assert_array_equal(bitmask.bits[1 + j], e.structured.fill_now([step])[0])
        if j < len(drafts):
            assert step.consume_token(drafts[j])
    np.testing.assert_array_equal(bitmask.bits[0], bitmask.bits[1])
    assert m.validate_tokens(drafts) == len(drafts) and not m.is_stopped()  # rolled back
    # A draft the grammar refuses (never proposed, but the rows must stay usable): the row before it
    # refuses it, the rows after it allow everything and are never reached.
    bad = drafts[:2] + tok.encode("x", add_special_tokens=False)
    rows = e.structured.start_bitmask([r], [bad]).result()
    allowed = rows.allowed(2, e.model_config.vocab_size)
    assert allowed[drafts[2]] and not allowed[bad[2]] and rows.allowed(3, e.model_config.vocab_size).all()
    assert m.validate_tokens(drafts) == len(drafts)


def test_draft_guide_masks_advances_and_rolls_back(tiny):
    e = make_engine(tiny)
    tok = tiny.tokenizer
    guided = e.add_request("d", [5, 6], SamplingParams(temperature=0.0, max_tokens=20,
                                                       structured_outputs=SO(choice=["77"]))).seqs[0]
    free = e.add_request("free", [5, 7], SamplingParams(temperature=0.0, max_tokens=20)).seqs[0]
    seven = tok.encode("7", add_special_tokens=False)
    guide = DraftGuide(e.structured, [free, guided])
    masked = guide.mask(np.zeros((2, e.model_config.vocab_size), np.float32), [0, 1], np)
    assert np.isfinite(masked[0]).all() and seven[0] in np.flatnonzero(np.isfinite(masked[1]))
    assert guide.advance(0, 123) and guide.advance(1, seven[0])  # "7": one more to go
    masked = guide.mask(np.zeros((1, e.model_config.vocab_size), np.float32), [1], np)
    assert np.flatnonzero(np.isfinite(masked[0])).tolist() == seven  # the state after the draft
    assert not guide.advance(1, seven[0])  # "77": the choice is complete, draft no further
    guide.rollback()
    m = e.structured.matcher(guided)
    assert not m.is_stopped() and m.validate_tokens(seven * 2) == 2


def test_grammar_completing_on_the_last_allowed_token_is_a_stop(tiny, data_dir):
    """A grammar complete exactly at max_tokens: the output is whole, finish_reason "stop" (beam search, plain
    decoding, and with drafts accepted up to the last token); one cut short is "length"."""
    free = run_all(_one(make_engine(tiny), 40))["d"].outputs[0]
    n = len(free.token_ids)
    assert re.fullmatch(DATE, free.text) and free.finish_reason == "stop"
    for spec in (None, specs(data_dir)["same_draft"]):
        exact = run_all(_one(make_engine(tiny, spec), n))["d"].outputs[0]
        assert exact.token_ids == free.token_ids and exact.finish_reason == "stop"
        cut = run_all(_one(make_engine(tiny, spec), n - 1))["d"].outputs[0]
        assert cut.token_ids == free.token_ids[:-1] and cut.finish_reason == "length"

    def beams(max_tokens):
        e = make_engine(tiny)
        e.add_beam_request("b", [5, 6, 7], BeamSearchParams(beam_width=3, max_tokens=max_tokens,
                                                            structured_outputs=SO(regex=DATE)))
        return run_all(e)["b"].outputs

    longest = max(len(c.token_ids) for c in beams(40))
    at_limit = beams(longest)
    assert any(len(c.token_ids) == longest for c in at_limit)
    for c in at_limit:  # every hypothesis is a whole date: "stop", also those of exactly max_tokens tokens
        assert re.fullmatch(DATE, c.text) and c.finish_reason == "stop", c
    short = beams(longest - 1)
    assert any(c.finish_reason == "length" for c in short)
    for c in short:
        assert (c.finish_reason == "stop") == bool(re.fullmatch(DATE, c.text)), c


def _one(engine, max_tokens):
    engine.add_request("d", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                      structured_outputs=SO(regex=DATE)))
    return engine


def guided_samples(engine, num, seed_base, regex, max_tokens):
    """The outputs (token id tuples) of `num` seeded samples of one prompt under `regex` at temperature 1.5."""
    for i in range(num):
        engine.add_request(str(i), [7, 3, 9, 4], SamplingParams(temperature=1.5, max_tokens=max_tokens,
                                                               seed=seed_base + i,
                                                               structured_outputs=SO(regex=regex)))
    done = run_all(engine)
    return [tuple(done[str(i)].outputs[0].token_ids) for i in range(num)]


@pytest.mark.slow
def test_guided_samples_with_a_draft_model_match_the_distribution_without_speculation(tiny):
    """3,000 guided samples of up to 4 tokens, with a sampling self-draft (k = 2: two verified drafts, then the
    bonus) and without: one joint distribution. The draft draws under the grammar's mask, so q is what its
    drafts came from (spec_grammar.py says why cutting unmasked draws instead would not be exact); about
    70% of the drafts are accepted here, so both the acceptances and the residual draws matter."""
    from chi_square import two_sample

    regex = r"[a-p]{4,8}"
    kw = dict(max_num_batched_tokens=4096, max_num_seqs=256, num_kv_blocks=1024)
    num = 3000
    plain = guided_samples(make_engine(tiny, **kw), num, 0, regex, 4)
    spec = {"method": "draft", "draft_num_layers": 1, "num_speculative_tokens": 2, "min_acceptance_rate": 0.0}
    e = make_engine(tiny, spec, **kw)
    speculated = guided_samples(e, num, 10 ** 6, regex, 4)
    stats = e.spec.stats
    assert stats.num_draft_tokens >= num and 0.2 < stats.acceptance_rate < 0.95
    keys = {k: n for n, k in enumerate(sorted(set(plain) | set(speculated)))}
    counts = [np.bincount([keys[k] for k in s], minlength=len(keys)) for s in (plain, speculated)]
    stat, df, p_value = two_sample(*counts)
    assert df > 5, "the test needs a spread-out distribution"
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {df} degrees of freedom, p = {p_value:.2e}"
