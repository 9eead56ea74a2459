"""Rejection sampling is exact: speculated tokens follow the target's distribution, whatever the drafts.

A synthetic target over 8 tokens (a Markov chain: token t's distribution depends on token t - 1) and a
different draft chain q. 20,000 sequences of 3 tokens are drawn speculatively (k = 2 drafts from q,
verified by RejectionSampler; when fewer than 3 tokens come out, the rest are drawn from the target
directly) and their joint counts are compared with the exact target probabilities by a chi-square test.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from chi_square import goodness_of_fit

from pagedserve.runtime.sample.rejection_sampler import RejectionSampler, dense_probs
from pagedserve.runtime.core.request import Request
from pagedserve.runtime.sampling_params import SamplingParams

V = 8
NUM_SAMPLES = 20_000


def _chain(seed: int, sharpness: float) -> tuple[np.ndarray, np.ndarray]:
    """(first-token logits [V], transition logits [V, V])."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(V) * sharpness, rng.standard_normal((V, V)) * sharpness


def _truncated(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The target distribution under `params`, computed independently (sorting, by hand)."""
    x = logits / params.temperature
    p = np.exp(x - x.max())
    order = np.argsort(-p)
    keep = np.zeros(V, bool)
    k = params.top_k if params.top_k > 0 else V
    keep[order[:k]] = True
    p = p * keep / (p * keep).sum()
    if params.top_p < 1:
        desc = p[order]
        before = np.cumsum(desc) - desc
        keep2 = np.zeros(V, bool)
        keep2[order[before < params.top_p]] = True
        p = p * keep2 / (p * keep2).sum()
    if params.min_p > 0:
        p = p * (p >= params.min_p * p.max())
    return p / p.sum()


def _request(params: SamplingParams, i: int) -> Request:
    return Request(str(i), [0], params, 0.0)


def _speculate(params: SamplingParams, one_hot: bool, accept_seed: int = 0) -> np.ndarray:
    """Counts [V, V, V] of 3-token continuations drawn with k = 2 drafts."""
    first, trans = _chain(1, 1.5)
    q_first, q_trans = _chain(2, 1.5)  # the draft: a different chain
    rng = np.random.default_rng(1234)
    n = NUM_SAMPLES
    p1, pt = _truncated(first, params), np.stack([_truncated(trans[a], params) for a in range(V)])
    q1 = np.exp(q_first) / np.exp(q_first).sum()
    qt = np.exp(q_trans) / np.exp(q_trans).sum(axis=1, keepdims=True)

    def draw(probs: np.ndarray) -> np.ndarray:  # one token per row
        return (rng.random(len(probs))[:, None] > np.cumsum(probs, axis=1)).sum(axis=1).clip(0, V - 1)

    if one_hot:  # n-gram style: fixed drafts (the most likely tokens under q), q one-hot
        d1 = np.full(n, int(np.argmax(q1)))
        d2 = np.argmax(qt[d1], axis=1)
        q = [None] * n
    else:
        d1 = draw(np.broadcast_to(q1, (n, V)))
        d2 = draw(qt[d1])
        q = list(np.stack([np.broadcast_to(q1, (n, V)), qt[d1]], axis=1).astype(np.float32))
    rows = np.stack([np.broadcast_to(first, (n, V)), trans[d1], trans[d2]], axis=1).reshape(3 * n, V)
    sampler = RejectionSampler(np.random.default_rng(accept_seed))
    outs = sampler(rows.astype(np.float32), [_request(params, i) for i in range(n)],
                   [[int(a), int(b)] for a, b in zip(d1, d2)], q)
    toks = np.full((n, 3), -1)
    for s, o in enumerate(outs):
        assert 1 <= len(o.token_ids) <= 3 and o.num_accepted == len(o.token_ids) - 1
        toks[s, : len(o.token_ids)] = o.token_ids
    for t in (1, 2):  # the verify step emitted fewer than 3: continue from the target itself
        short = np.flatnonzero(toks[:, t] < 0)
        toks[short, t] = draw(pt[toks[short, t - 1]])
    counts = np.zeros((V, V, V), np.int64)
    np.add.at(counts, (toks[:, 0], toks[:, 1], toks[:, 2]), 1)
    expected = p1[:, None, None] * pt[:, :, None] * pt[None, :, :]
    return counts, expected


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_q", "ngram_one_hot"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
], ids=["plain", "truncated"])
def test_speculated_tokens_follow_the_target_distribution(params, one_hot):
    counts, expected = _speculate(params, one_hot)
    stat, df, p_value = goodness_of_fit(counts, expected)
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {df} degrees of freedom, p = {p_value:.2e}"


def test_dense_probs_match_an_independent_truncation():
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((6, V)) * 2).astype(np.float32)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in itertools.product([0.5, 1.3], [0, 3], [1.0, 0.8], [0.0])][:6]
    got = dense_probs(logits, params)
    for row, p in zip(range(6), params):
        np.testing.assert_allclose(got[row], _truncated(logits[row].astype(np.float64), p), rtol=1e-5, atol=1e-7)


def test_greedy_accepts_while_the_draft_is_the_argmax():
    logits = np.full((4, V), -5.0, np.float32)
    for row, best in enumerate([3, 1, 6, 2]):
        logits[row, best] = 5.0
    sampler = RejectionSampler(np.random.default_rng(0))
    greedy = SamplingParams(temperature=0.0)
    all_in, = sampler(logits, [_request(greedy, 0)], [[3, 1, 6]], [None])
    assert all_in.token_ids == [3, 1, 6, 2] and all_in.num_accepted == 3  # the bonus token
    stop, = sampler(logits, [_request(greedy, 0)], [[3, 4, 6]], [None])
    assert stop.token_ids == [3, 1] and stop.num_accepted == 1  # the target's own token where they differ
    # Logprobs are the raw log-softmax of each emitted token's row.
    lse = np.log(np.exp(logits[0].astype(np.float64)).sum())
    assert stop.logprobs[0] == pytest.approx(5.0 - lse, abs=1e-6)


def test_penalties_and_the_min_tokens_ban_see_the_drafts_before_each_row():
    # A repetition penalty strong enough to flip row 1's argmax if it sees draft 3 there.
    logits = np.zeros((2, V), np.float32)
    logits[0, 3] = 2.0
    logits[1, 3], logits[1, 5] = 2.0, 1.5
    sampler = RejectionSampler(np.random.default_rng(0))
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out, = sampler(logits, [_request(p, 0)], [[3]], [None])
    assert out.token_ids == [3, 5]
    # min_tokens=2 with eos 7: row 0 (1 output so far: allowed? no, 0 outputs) bans 7, row 1 (after one
    # draft, 1 output) still bans it; the argmax 7 is never emitted.
    logits = np.zeros((2, V), np.float32)
    logits[:, 7] = 9.0
    logits[:, 4] = 1.0
    r = Request("0", [0], SamplingParams(temperature=0.0, min_tokens=2), 0.0, eos_token_ids=(7,))
    out, = sampler(logits, [r], [[4]], [None])
    assert out.token_ids == [4, 4]
