"""Faults injected into each stage of a step fail the request at fault alone; the others carry on.

Every test runs one "bad" request among good ones, makes one stage raise for it (monkeypatch), and
checks: the bad request ends with an error naming the stage and no KV block; every good request
gives the very tokens it gives in a clean run; the block pool is consistent after every step.
"""

from __future__ import annotations

import functools

import pytest

import engine_helpers
from engine_helpers import drain

from pagedserve.runtime.engine import model_runner
from pagedserve.runtime.sampling_params import SamplingParams

POISON = 499  # a token id that only the bad request's prompt holds
GOOD = {f"good{i}": [3 + (i * 11 + j) % 400 for j in range(7 + 9 * i)] for i in range(4)}
BAD_PROMPT = [5, 6, POISON, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


make_engine = functools.partial(engine_helpers.make_engine, num_kv_blocks=64, max_num_batched_tokens=32)


def params(**kw):
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def reference(tiny):
    e = make_engine(tiny)
    for rid, prompt in GOOD.items():
        e.add_request(rid, prompt, params())
    return {rid: o.outputs[0].token_ids for rid, o in run(e).items()}


def run(e, late=None):
    """drain(e); with `late`, those requests arrive after the third step, however many are unfinished then."""
    done = {}
    if late:
        for _ in range(3):
            for out in e.step():
                if out.finished:
                    assert out.request_id not in done
                    done[out.request_id] = out
            e.check_integrity()
        for rid, prompt in late.items():
            e.add_request(rid, prompt, params())
    rest = drain(e, max_steps=500)
    assert not set(rest) & set(done), "a request finished twice"
    return {**done, **rest}


def check(e, done, reference, stage_words):
    bad = done["bad"]
    assert bad.error is not None and stage_words in bad.error and "injected" in bad.error, bad.error
    for rid, tokens in reference.items():
        assert done[rid].error is None and done[rid].outputs[0].token_ids == tokens, rid
    assert e.kv_manager.usage().num_used_blocks == 0 and not e.groups


def start(tiny, bad_params=None):
    e = make_engine(tiny)
    e.add_request("bad", BAD_PROMPT, bad_params or params())
    for rid, prompt in GOOD.items():
        e.add_request(rid, prompt, params())
    return e


@pytest.mark.parametrize("when", ["admission", "decode"])
def test_scheduling(tiny, reference, monkeypatch, when):
    e = start(tiny)
    kv = e.kv_manager
    if when == "admission":
        real = kv.allocate_with_prefix

        def allocate_with_prefix(seq_id, cached, num_new):
            if seq_id == "bad":
                raise RuntimeError("injected scheduling fault")
            return real(seq_id, cached, num_new)

        monkeypatch.setattr(kv, "allocate_with_prefix", allocate_with_prefix)
    else:
        real = kv.allocate_slots

        def allocate_slots(seq_id, num_computed, num_new):
            if seq_id == "bad" and num_computed > len(BAD_PROMPT) + 3:  # mid-decode, holding blocks
                raise RuntimeError("injected scheduling fault")
            return real(seq_id, num_computed, num_new)

        monkeypatch.setattr(kv, "allocate_slots", allocate_slots)
    check(e, run(e), reference, "while scheduling it")


def test_preparing_the_batch(tiny, reference, monkeypatch):
    real = model_runner.SeqChunk

    def seq_chunk(token_ids, *args, **kw):
        if POISON in token_ids:
            raise RuntimeError("injected prepare fault")
        return real(token_ids, *args, **kw)

    monkeypatch.setattr(model_runner, "SeqChunk", seq_chunk)
    e = start(tiny)
    check(e, run(e), reference, "while preparing it")


def test_sampling(tiny, reference, monkeypatch):
    e = start(tiny, params(seed=666))
    real = e.runner.sampler

    def sampler(logits, ps, gens, prompts, outputs, **kw):
        if any(p.seed == 666 and len(o) >= 3 for p, o in zip(ps, outputs)):
            raise FloatingPointError("injected sampling fault")
        return real(logits, ps, gens, prompts, outputs, **kw)

    monkeypatch.setattr(e.runner, "sampler", sampler)
    done = run(e)
    check(e, done, reference, "while sampling its next token")
    assert len(done["bad"].outputs[0].token_ids) == 3  # what it had before the fault is returned


def test_detokenizing(tiny, reference):
    e = start(tiny)
    detok = e.groups["bad"].seqs[0].detokenizer
    real = detok.add_tokens

    def add_tokens(ids):
        if detok.output_text and len(detok.output_text) > 2:
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "injected detokenizer fault")
        return real(ids)

    detok.add_tokens = add_tokens
    check(e, run(e), reference, "while updating and detokenizing its output")


def test_parallel_samples_fail_together_and_free_every_block(tiny, reference, monkeypatch):
    e = start(tiny, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))
    real = e.runner.sampler

    def sampler(logits, ps, gens, prompts, outputs, **kw):
        if any(p.n == 3 for p in ps) and any(len(o) >= 4 for o in outputs):
            raise RuntimeError("injected sampling fault")
        return real(logits, ps, gens, prompts, outputs, **kw)

    monkeypatch.setattr(e.runner, "sampler", sampler)
    check(e, run(e), reference, "while sampling")


def test_failed_forward_fails_its_batch_only(tiny, reference, monkeypatch):
    e = start(tiny)
    model = e.executor.driver_worker.model
    real = model.forward
    in_batch: list[str] = []

    def forward(batch, kv_caches):
        if POISON in batch.input_ids.tolist() and not in_batch:
            in_batch.extend(s.request.request_id for s in e._last_sched.scheduled)
            raise MemoryError("injected forward fault")
        return real(batch, kv_caches)

    real_schedule = e.scheduler.schedule

    def schedule():
        e._last_sched = real_schedule()
        return e._last_sched

    monkeypatch.setattr(model, "forward", forward)
    monkeypatch.setattr(e.scheduler, "schedule", schedule)
    late = {f"late{i}": [9 + i, 40, 41, 42 + i] for i in range(3)}
    done = run(e, late=late)
    assert "bad" in in_batch
    failed = {rid for rid, o in done.items() if o.error is not None}
    assert failed == set(in_batch), (failed, in_batch)
    assert all("while running the forward pass of its batch" in done[r].error for r in failed)
    clean = make_engine(tiny)
    for rid, prompt in {**GOOD, **late}.items():
        clean.add_request(rid, prompt, params())
    ref = {rid: o.outputs[0].token_ids for rid, o in run(clean).items()}
    for rid in set(GOOD) | set(late):
        if rid not in failed:
            assert done[rid].outputs[0].token_ids == ref[rid], rid
    assert set(late) - failed == set(late)  # queued after the fault: untouched
    assert e.kv_manager.usage().num_used_blocks == 0 and not e.groups
