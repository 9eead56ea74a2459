"""logit_bias (OpenAI's): validated in SamplingParams, checked against the vocabulary before anything is
allocated, and added to the raw logits before penalties (numpy reference: plain addition)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.runtime.engine.request_limits import RequestLimits, ServerShape, check_params
from pagedserve.runtime.sample.sampler import Sampler, apply_penalties_and_bans
from pagedserve.runtime.sampling_params import SamplingParams


def test_validation_names_the_field():
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={3: 1}).logit_bias == {3: 1.0}
    for bias, needle in [({3: 101}, r"logit_bias\[3\] must be in \[-100, 100\]"),
                         ({3: float("nan")}, r"logit_bias\[3\] must be finite"),
                         ({-1: 0.0}, "logit_bias keys must be non-negative token ids"),
                         ({"3": 0.0}, "logit_bias keys must be non-negative token ids"),
                         ([1, 2], "logit_bias must be a dict")]:
        with pytest.raises(ValueError, match=needle):
            SamplingParams(logit_bias=bias)
    shape = ServerShape(vocab_size=100, max_model_len=64, max_num_seqs=4, num_kv_blocks=16, block_size=16)
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 100\); got \[100\]"):
        check_params(RequestLimits(), shape, SamplingParams(logit_bias={5: 1.0, 100: 1.0}))


def test_bias_is_added_to_its_rows_only():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    params = [SamplingParams(logit_bias={7: 5.0, 9: -2.5}), SamplingParams(), SamplingParams(logit_bias={0: 1.0})]
    out = apply_penalties_and_bans(logits, params, [[]] * 3, [[]] * 3)
    expected = logits.copy()
    expected[0, 7] += 5.0
    expected[0, 9] -= 2.5
    expected[2, 0] += 1.0
    np.testing.assert_array_equal(out, expected)
    assert apply_penalties_and_bans(logits, [SamplingParams()] * 3, [[]] * 3, [[]] * 3) is logits


def test_bias_steers_greedy_and_random_picks_but_not_the_reported_logprobs():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 64)).astype(np.float32)
    top = int(np.argmax(logits[0]))
    forced = 11 if top != 11 else 12
    params = [SamplingParams(temperature=0.0, logprobs=0, logit_bias={forced: 100.0, top: -100.0}),
              SamplingParams(temperature=1.0, seed=3, logit_bias={forced: 100.0})]
    out = Sampler(0)(logits, params, [None, np.random.default_rng(3)], [[]] * 2, [[]] * 2)
    assert out.token_ids.tolist() == [forced, forced]
    raw = logits[0].astype(np.float64)
    raw_lp = raw[forced] - raw.max() - np.log(np.exp(raw - raw.max()).sum())
    assert abs(float(out.logprobs[0]) - raw_lp) < 1e-5  # raw logprobs, as for every other processing
