"""The speculation policy's start-up calibration: this host's step costs, cached, and what they decide."""

from __future__ import annotations

import json

import numpy as np
import pytest

import engine_helpers
from engine_helpers import drain

from pagedserve.runtime.sampling_params import SamplingParams
from pagedserve.runtime.spec_decode import calibration
from pagedserve.runtime.spec_decode.policy import Candidate, SpecPolicy


def test_the_cache_keeps_figures_by_key_and_survives_a_bad_file(tmp_path):
    path = tmp_path / "costs.json"
    assert calibration.load("a", path) is None  # no file
    calibration.store("a", {1: 0.01, 5: 0.02}, path)
    calibration.store("b", {1: 0.03}, path)
    assert calibration.load("a", path) == {1: 0.01, 5: 0.02}
    assert calibration.load("b", path) == {1: 0.03}
    assert calibration.load("c", path) is None  # another host, code path or model
    for i in range(calibration.MAX_ENTRIES + 3):
        calibration.store(f"k{i}", {1: 0.01}, path)
    data = json.loads(path.read_text())
    assert len(data) == calibration.MAX_ENTRIES and "a" not in data  # the oldest entries went first
    path.write_text("{not json")
    assert calibration.load("k40", path) is None
    calibration.store("a", {1: 0.5}, path)  # a broken file is replaced, not an error
    assert calibration.load("a", path) == {1: 0.5}
    path.write_text(json.dumps({"a": {"seconds": {"1": -1.0}}}))
    assert calibration.load("a", path) is None  # nonsense figures are not used


def test_measure_keeps_the_cheapest_run_per_row_count_and_stops_at_its_budget():
    calls, now = [], [0.0]

    def forward(m):
        calls.append(m)
        now[0] += 0.01 * m + (0.05 if len(calls) % 3 == 2 else 0.0)  # every third call disturbed

    got = calibration.measure(forward, lambda: now[0], rows=(1, 2, 3), repeats=2)
    assert got == pytest.approx({1: 0.01, 2: 0.02, 3: 0.03})
    assert calls == [1, 1, 1, 2, 2, 2, 3, 3, 3]  # one untimed run, then the timed ones
    calls.clear()
    assert list(calibration.measure(forward, lambda: now[0], rows=(1, 2, 3), budget_s=0.0)) == [1]


def test_seed_policy_measures_once_then_loads(tmp_path):
    path, calls = tmp_path / "costs.json", []
    clock = iter(np.arange(0, 100, 0.01)).__next__

    def forward(m):
        calls.append(m)

    p = SpecPolicy(4, 12, 16, None, False, True)
    assert calibration.seed_policy(p, "host", forward, clock, path) == "measured"
    assert calls and set(p.costs.seconds) == set(calibration.ROWS)
    calls.clear()
    q = SpecPolicy(4, 12, 16, None, False, True)
    assert calibration.seed_policy(q, "host", forward, clock, path) == "cached"
    assert calls == [] and q.costs.seconds == p.costs.seconds


def costs(decode_s, per_row_s):
    return {m: decode_s + per_row_s * (m - 1) for m in calibration.ROWS}


def test_a_new_engine_drafts_nothing_where_this_hosts_costs_say_it_cannot_pay():
    def seq(p):  # a new sequence whose first lookup's first token came true (checked unverified)
        rec = p.new_record()
        p._learn(rec, 1, 1)
        return Candidate("seq", rec, 4)

    fresh = SpecPolicy(4, 12, 16, None, False, True)
    cand = seq(fresh)
    # The prior's shape (a 5-row step ~2.7 decode steps) lets a new sequence try its prior acceptance...
    assert fresh.choose([cand], 1) == [cand]
    # ...but on a host measured at 0.8 decode steps a row (5 rows: 4.2 steps) that loses: nothing is drafted.
    dear = SpecPolicy(4, 12, 16, None, False, True)
    dear.costs.seed(costs(0.010, 0.008))
    assert dear.choose([seq(dear)], 1) == []
    # Where verify rows are cheap (5 rows: 1.2 steps), the same sequence speculates from its first chance.
    cheap = SpecPolicy(4, 12, 16, None, False, True)
    cheap.costs.seed(costs(0.010, 0.0005))
    assert cheap.choose([seq(cheap)], 1) != []
    cheap.observe_step(5, 0.05)  # and steps the engine then times move the seeded figures as before
    assert cheap.costs.estimate(5) > 0.012


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The calibration file in a fresh folder (not PAGEDSERVE_CACHE_DIR: the kernels' caches stay where they are)."""
    monkeypatch.setattr(calibration, "cache_file", lambda: tmp_path / calibration.FILE_NAME)
    return tmp_path


SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 16}


def test_an_engine_calibrates_on_its_first_start_and_loads_the_figures_on_the_next(tiny, cache_dir):
    e = engine_helpers.make_engine(tiny, speculative_config=SUFFIX)
    data = json.loads((cache_dir / calibration.FILE_NAME).read_text())
    (key, entry), = data.items()
    assert calibration.cpu_name() in key and "tiny-llama" in key
    assert set(map(int, entry["seconds"])) <= set(calibration.ROWS) and "1" in entry["seconds"]
    assert e.spec.policy.costs.seconds == {int(m): s for m, s in entry["seconds"].items()}
    e2 = engine_helpers.make_engine(tiny, speculative_config=SUFFIX)
    assert e2.spec.policy.costs.seconds == e.spec.policy.costs.seconds
    assert e2.spec.calibrate(e2.executor, e2.block_size, 64) == "cached"


def test_no_calibration_when_speculation_is_off_or_a_fixed_threshold_replaces_the_costs(tiny, cache_dir):
    engine_helpers.make_engine(tiny)
    engine_helpers.make_engine(tiny, speculative_config={**SUFFIX, "min_acceptance_rate": 0.0})
    assert not (cache_dir / calibration.FILE_NAME).exists()


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_where_verify_rows_cost_what_decode_steps_cost_nothing_is_drafted_and_tokens_are_the_same(
        tiny, cache_dir, monkeypatch, method):
    """A host where m rows cost m decode steps: no draft can pay (1 + accepted <= 1 + d), even on a prompt
    that repeats itself; the proposals are still checked unverified. Where rows are nearly free the policy starts
    from those costs, and whether it drafts is then the checked proposals' call (this random tiny model does not
    go on copying its prompt, so its lookups mostly fail unverified); the tokens are the same either way."""
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 512, size=12)] * 4
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = {"method": method, "num_speculative_tokens": 4}

    def run(per_row_s):
        monkeypatch.setattr(calibration, "measure", lambda *a, **k: costs(0.010, per_row_s))
        for f in cache_dir.iterdir():
            f.unlink()
        e = engine_helpers.make_engine(tiny, speculative_config=spec)
        e.start_ratio = e.spec.policy.costs.ratio(5, 1)  # what the first step decides on (steps then move it)
        e.add_request("a", prompt, params)
        return e, drain(e)["a"].outputs[0].token_ids

    plain = engine_helpers.make_engine(tiny)
    plain.add_request("a", prompt, params)
    want = drain(plain)["a"].outputs[0].token_ids
    e, got = run(0.010)
    assert got == want and e.spec.stats.num_draft_tokens == 0 and e.start_ratio == pytest.approx(5.0)
    assert e.spec.policy.num_shadow_checked > 0
    e, got = run(0.0001)
    assert got == want and e.spec.policy.num_shadow_checked + e.spec.stats.num_draft_tokens > 0
    assert e.start_ratio < 1.1  # started from the cheap rows' costs (the dear host's: 5)
