"""Structured outputs on the tiny committed model: validation, the bitmask, the compile cache, the
scheduler's wait for a grammar, and guided requests under n > 1, preemption, chunked prefill and prefix
caching (with speculative decoding: test_spec_grammar.py). A random-weight model is the harsh case for a
grammar: it picks among the allowed tokens almost at random, so the mask alone keeps the output in the language."""

from __future__ import annotations

import functools
import re
from concurrent.futures import Future

import numpy as np
import pytest

import engine_helpers
from engine_helpers import drain

from pagedserve.runtime.sample.sampling_ops import apply_token_bitmask
from pagedserve.runtime.sampling_params import SamplingParams
from pagedserve.runtime.structured_outputs_params import MAX_CONSTRAINT_CHARS, StructuredOutputsParams as SO

DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"


make_engine = functools.partial(engine_helpers.make_engine, max_num_batched_tokens=256, num_kv_blocks=256)


run_all = drain


# -- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(regex="(("), r"structured_outputs\.regex is not a valid regular expression: .*unclosed group"),
    (dict(json='{"type": "foo"}'), r"structured_outputs\.json is not a valid JSON Schema: Invalid type: foo"),
    (dict(json="{nope"), r"structured_outputs\.json is not valid JSON"),
    (dict(json={"$ref": "#/$defs/missing"}), r"structured_outputs\.json is not a valid JSON Schema: .*missing"),
    (dict(grammar="start: foo"), r"structured_outputs\.grammar is not a valid grammar: .*unknown name"),
    (dict(grammar="root ::= ("), r"structured_outputs\.grammar is not a valid grammar: .*GBNF"),
    (dict(choice=[]), r"structured_outputs\.choice must be a non-empty list"),
    (dict(choice=["a", ""]), r"structured_outputs\.choice\[1\] must be a non-empty string"),
    (dict(choice="ab"), r"structured_outputs\.choice must be a non-empty list"),
    (dict(), r"exactly one of .* got none"),
    (dict(regex="a", choice=["b"]), r"exactly one of .* got regex, choice"),
    (dict(json_object=1), r"structured_outputs\.json_object must be True"),
    (dict(regex="a" * (MAX_CONSTRAINT_CHARS + 1)), r"structured_outputs\.regex is .* characters; the limit"),
])
def test_bad_constraints_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        SO(**kwargs)
    assert len(str(e.value)) < 320  # llguidance's message is quoted, cut to ~200 characters


def test_good_constraints_and_gbnf():
    assert SO(grammar='root ::= "yes" | "no"').kind == "grammar"
    assert SO(json='{"type": "integer"}').grammar_text == SO(json={"type": "integer"}).grammar_text
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_bad_constraint_takes_no_block(tiny):
    engine = make_engine(tiny)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        engine.add_request("r", [5, 6, 7], SamplingParams(structured_outputs=SO(regex="[")))
    assert not engine.has_unfinished_requests() and engine.kv_manager.usage().num_used_blocks == 0


def test_a_character_the_vocabulary_cannot_produce_is_refused(smollm2_loaded):
    # Found by the reliability fuzz: SmolLM2's byte-level vocabulary has no token holding byte 0x06, so
    # a regex needing it can never match; llguidance's mask then let a wrong token through, its parser
    # refused that token, and the request failed INTERNAL mid-stream. It is now refused up front.
    from pagedserve.runtime.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(smollm2_loaded.tokenizer, smollm2_loaded.config.vocab_size)
    missing = manager.compiler.unproducible_bytes()
    assert 0x06 in missing and 0x1B not in missing and not missing & set(b"az{}\n")
    for kwargs, field in [(dict(regex="vR8\u00bf\x1bz\x06"), "regex"), (dict(choice=["ok", "n\x06o"]), "choice")]:
        with pytest.raises(ValueError, match=rf"structured_outputs\.{field} holds '\\x06', which no token"):
            manager.compile(SO(**kwargs))
    assert manager.compile(SO(regex="vR8\u00bf\x1bz")).result().is_error() is False  # ESC has a token
    assert manager.compile(SO(json={"const": "a\u0006"})).result() is not None  # JSON escapes it: allowed


# -- the bitmask ------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [70, 96])
def test_apply_token_bitmask_matches_llguidance_reference(vocab):
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    rows = np.array([4, 1, 2])
    bits = rng.integers(-(2**31), 2**31, size=(3, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    got = apply_token_bitmask(logits, rows, bits)
    want = logits.copy()
    sub = want[rows]
    apply_token_bitmask_inplace(sub, bits)  # llguidance's own numpy reference
    want[rows] = sub
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(logits).all()  # copy=True left the input alone
    # The device path (bit shifts instead of np.unpackbits), run here through a stand-in for CuPy.
    np.testing.assert_array_equal(apply_token_bitmask(logits, rows, bits, xp=_NumpyAsDevice()), want)
    first3 = logits[:3].copy()
    whole = apply_token_bitmask(first3, np.arange(3), bits, copy=False)  # every row: written in place
    assert whole is first3
    ref = logits[:3].copy()
    apply_token_bitmask_inplace(ref, bits)
    np.testing.assert_array_equal(whole, ref)


class _NumpyAsDevice:
    """numpy under another name: array code takes its xp (CuPy) branch."""

    def __getattr__(self, name):
        return getattr(np, name)


# -- compile cache and the scheduler's wait ---------------------------------------------------------


def test_compile_cache_is_shared_and_bounded(tiny):
    engine = make_engine(tiny)
    compiler = engine.structured.compiler
    compiler.cache_size = 2
    a, b, c = SO(regex="a+"), SO(regex="b+"), SO(regex="c+")
    fa = compiler.submit(a.grammar_text)
    assert compiler.submit(SO(regex="a+").grammar_text) is fa and compiler.num_hits == 1
    compiler.submit(b.grammar_text)
    compiler.submit(c.grammar_text)  # evicts a (least recently used)
    assert compiler.submit(a.grammar_text) is not fa
    assert fa.result(timeout=30).is_accepting() is False  # the template was never advanced


def test_request_waits_for_its_grammar_and_others_run(tiny):
    engine = make_engine(tiny)
    pending: Future = Future()
    real_submit = engine.structured.compiler.submit
    engine.structured.compiler.submit = lambda text: pending
    engine.add_request("guided", [5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=SO(regex=DATE)))
    engine.structured.compiler.submit = real_submit
    engine.add_request("free", [8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    finished = {}
    for _ in range(3):
        for out in engine.step():
            finished[out.request_id] = out
    assert "free" in finished and finished["free"].finished
    guided = engine.groups["guided"].seqs[0]
    assert guided.waiting_for_grammar and guided.num_computed_tokens == 0
    assert engine.kv_manager.usage().num_used_blocks == 0  # waiting for its grammar, it holds no block
    pending.set_result(real_submit(SO(regex=DATE).grammar_text).result(timeout=30))
    out = run_all(engine)["guided"].outputs[0]
    assert re.fullmatch(DATE, out.text) and out.finish_reason == "stop"


def test_grammar_failing_to_compile_aborts_without_blocks(tiny):
    engine = make_engine(tiny)
    failed: Future = Future()
    failed.set_exception(ValueError("structured_outputs could not be compiled"))
    engine.structured.compiler.submit = lambda text: failed
    engine.add_request("bad", [5, 6], SamplingParams(structured_outputs=SO(regex="a")))
    out = run_all(engine)["bad"]
    assert out.outputs[0].finish_reason == "abort"


# -- guided generation ------------------------------------------------------------------------------


def test_regex_choice_and_length(tiny):
    engine = make_engine(tiny)
    engine.add_request("date", [5, 6, 7], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=20,
                                                         structured_outputs=SO(regex=DATE)))
    engine.add_request("choice", [5, 9], SamplingParams(n=4, temperature=1.0, seed=2, max_tokens=20,
                                                        structured_outputs=SO(choice=["red", "green", "blue"])))
    engine.add_request("cut", [5, 9], SamplingParams(temperature=1.0, seed=3, max_tokens=3,
                                                     structured_outputs=SO(regex="[a-z]{20}")))
    out = run_all(engine)
    for c in out["date"].outputs:
        assert re.fullmatch(DATE, c.text) and c.finish_reason == "stop", c
    for c in out["choice"].outputs:
        assert c.text in ("red", "green", "blue") and c.finish_reason == "stop", c
    cut = out["cut"].outputs[0]
    assert cut.finish_reason == "length" and re.fullmatch("[a-z]+", cut.text) and len(cut.text) < 20


def test_eos_only_where_the_grammar_may_end(tiny):
    engine = make_engine(tiny)
    compiler = engine.structured.compiler
    assert compiler.ll_tokenizer.eos_tokens == list(engine.tokenizer.eos_token_ids)
    # [0-9]{2,} may end after two digits: outputs ending with EOS ("stop") have at least two.
    engine.add_request("d", [5], SamplingParams(n=8, temperature=1.0, seed=4, max_tokens=12,
                                                structured_outputs=SO(regex="[0-9]{2,}")))
    for c in run_all(engine)["d"].outputs:
        assert re.fullmatch("[0-9]+", c.text)
        if c.finish_reason == "stop":
            assert len(c.text) >= 2 and c.token_ids[-1] in engine.tokenizer.eos_token_ids


def test_best_of_and_stop_strings(tiny):
    engine = make_engine(tiny)
    engine.add_request("b", [5, 6], SamplingParams(n=2, best_of=4, temperature=1.0, seed=5, max_tokens=20,
                                                   structured_outputs=SO(regex=DATE)))
    engine.add_request("s", [5, 6], SamplingParams(temperature=1.0, seed=6, max_tokens=20, stop=["-"],
                                                   structured_outputs=SO(regex=DATE)))
    out = run_all(engine)
    assert len(out["b"].outputs) == 2 and all(re.fullmatch(DATE, c.text) for c in out["b"].outputs)
    s = out["s"].outputs[0]
    assert s.finish_reason == "stop" and s.stop_reason == "-" and re.fullmatch("[0-9]{4}", s.text)


def _guided_workload(n_requests=8):
    shared = list(range(3, 40))  # a common prefix of two full blocks: prefix-cache hits
    reqs = []
    for i in range(n_requests):
        prompt = shared + [40 + i] * (1 + 9 * i)
        so = SO(regex=DATE) if i % 3 else SO(json={"type": "object", "properties": {
            "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["ok", "n"], "additionalProperties": False})
        reqs.append((str(i), prompt, SamplingParams(n=2, temperature=1.0, seed=100 + i, max_tokens=24,
                                                    structured_outputs=so)))
    return reqs


def test_preemption_chunking_and_prefix_cache_change_nothing(tiny):
    """Seeded guided outputs are the same with a roomy engine and with a tiny KV pool (preemption and
    recompute), a small token budget (chunked prefill) and prefix caching."""
    import json

    def run(**kw):
        engine = make_engine(tiny, **kw)
        for rid, prompt, params in _guided_workload():
            engine.add_request(rid, prompt, params)
        out = run_all(engine)
        return engine, {rid: [(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for rid, o in out.items()}

    _, roomy = run(max_num_batched_tokens=2048, num_kv_blocks=512, enable_prefix_caching=False)
    tight, squeezed = run(max_num_batched_tokens=32, num_kv_blocks=24, block_size=8)
    assert tight.num_preemptions > 0
    assert tight.scheduler.num_cached_prompt_tokens > 0
    assert squeezed == roomy
    for rid, samples in roomy.items():
        for _, text, reason in samples:
            assert reason == "stop", (rid, text)
            if int(rid) % 3:
                assert re.fullmatch(DATE, text)
            else:
                assert set(json.loads(text)) == {"ok", "n"}


def test_guided_beam_search(tiny):
    """Every beam follows its own matcher (forked with it): all hypotheses are complete dates, best first."""
    from pagedserve.runtime.core.beam_search import BeamSearchParams, length_penalized

    engine = make_engine(tiny)
    engine.add_beam_request("b", [5, 6, 7], BeamSearchParams(beam_width=3, max_tokens=16,
                                                             structured_outputs=SO(regex=DATE)))
    engine.add_beam_request("c", [5, 9], BeamSearchParams(beam_width=2, max_tokens=8,
                                                          structured_outputs=SO(choice=["alpha", "beta", "gamma"])))
    out = run_all(engine)
    dates = out["b"].outputs
    assert len(dates) == 3 and len({c.text for c in dates}) == 3
    for c in dates:
        assert re.fullmatch(DATE, c.text) and c.finish_reason == "stop", c
    scores = [length_penalized(c.cumulative_logprob, len(c.token_ids), 1.0) for c in dates]
    assert scores == sorted(scores, reverse=True)
    assert {c.text for c in out["c"].outputs} <= {"alpha", "beta", "gamma"} and len(out["c"].outputs) == 2
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        BeamSearchParams(beam_width=2, structured_outputs="a")
