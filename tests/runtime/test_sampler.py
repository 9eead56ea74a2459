"""Tests for the batched sampler (numpy backend)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from numerics import f32_tol, max_abs

from pagedserve.runtime.sample.sampler import Sampler, SamplerOutput, apply_penalties_and_bans
from pagedserve.runtime.sampling_params import SamplingParams

# 4096 is a multiple of 16 wide enough for the two-level (grid) helpers; 1000 is not, so it takes
# the plain argpartition / cumsum paths.
VOCABS = [1000, 4096]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _softmax(x: np.ndarray) -> np.ndarray:
    return np.exp(_log_softmax(x))


def _run(
    sampler: Sampler,
    logits: np.ndarray,
    params: list[SamplingParams],
    generators: list[np.random.Generator | None] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    banned: list[list[int]] | None = None,
) -> SamplerOutput:
    b = logits.shape[0]
    return sampler(
        logits,
        params,
        generators if generators is not None else [None] * b,
        prompts if prompts is not None else [[] for _ in range(b)],
        outputs if outputs is not None else [[] for _ in range(b)],
        banned_token_ids=banned,
    )


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic over the support of probs, and its degrees of freedom."""
    support = probs > 0
    n = counts.sum()
    expected = probs[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


# Upper 0.1% points of chi-square; with a fixed seed each test is deterministic anyway.
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("kernel", ["numpy", "numba"])
def test_greedy_is_argmax(vocab: int, kernel: str) -> None:
    """Also with the numba set's argmax_rows (the engine passes backend.ops.argmax_rows), ties included."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((8, vocab)).astype(np.float32) * 4
    logits[1, -1] = logits[1].max()  # a tie: the first index wins
    argmax_rows = None
    if kernel == "numba":
        from pagedserve.cupy_kernels.numba_cpu import ops as numba_ops

        argmax_rows = numba_ops.argmax_rows
    out = _run(Sampler(0, argmax_rows=argmax_rows), logits, [SamplingParams.greedy()] * 8)
    assert out.token_ids.dtype == np.int64 and out.token_ids.shape == (8,)
    np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=1))
    if kernel == "numba":  # its log-normaliser, summed on the argmax's read: the numba set's logsumexp_rows bits
        from pagedserve.cupy_kernels.numba_cpu import ops as numba_ops

        both = _run(Sampler(0, numba_ops.logsumexp_rows), logits, [SamplingParams.greedy()] * 8)
        fused = _run(Sampler(0, numba_ops.logsumexp_rows, numba_ops.argmax_rows), logits, [SamplingParams.greedy()] * 8)
        np.testing.assert_array_equal(fused.logprobs, both.logprobs)


@pytest.mark.parametrize("vocab", VOCABS)
def test_top_k_1_and_tiny_top_p_equal_greedy(vocab: int) -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((16, vocab)).astype(np.float32) * 3
    expected = logits.argmax(axis=1)
    sampler = Sampler(1)
    for params in (
        SamplingParams(temperature=1.3, top_k=1),
        SamplingParams(temperature=1.3, top_p=1e-6),
        SamplingParams(temperature=1.3, top_k=20, top_p=1e-6),
        SamplingParams(temperature=1.3, min_p=1.0),
    ):
        for _ in range(3):
            out = _run(sampler, logits, [params] * 16)
            np.testing.assert_array_equal(out.token_ids, expected, err_msg=str(params))


def test_penalties_exact_numbers() -> None:
    logits = np.array([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 3, dtype=np.float32)
    prompts = [[0, 1], [0, 1], [0, 1]]
    outputs = [[1, 3, 3], [1, 3, 3], [1, 3, 3]]
    params = [
        # Repetition over prompt + output tokens {0, 1, 3}: divide positive, multiply negative.
        SamplingParams(repetition_penalty=2.0),
        # Presence/frequency over output tokens only: token 1 once, token 3 twice.
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        # Both: repetition first, then frequency and presence.
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
    ]
    out = apply_penalties_and_bans(logits, params, prompts, outputs)
    expected = np.array(
        [
            [1.0, -2.0, 0.5, 1.5, -2.0, 1.0],
            [2.0, -1.75, 0.5, 1.75, -2.0, 1.0],
            [1.0, -2.75, 0.5, 0.25, -2.0, 1.0],
        ],
        dtype=np.float32,
    )
    np.testing.assert_array_equal(out, expected)
    # The caller's logits are untouched.
    assert logits[0, 0] == 2.0


def test_penalties_noop_returns_input_and_bans_set_minus_inf() -> None:
    logits = np.arange(12, dtype=np.float32).reshape(2, 6)
    params = [SamplingParams(), SamplingParams()]
    assert apply_penalties_and_bans(logits, params, [[1], [2]], [[3], [4]]) is logits
    out = apply_penalties_and_bans(logits, params, [[], []], [[], []], [[5, 5, 0], []])
    assert out[0, 5] == -np.inf and out[0, 0] == -np.inf
    np.testing.assert_array_equal(out[0, 1:5], logits[0, 1:5])
    np.testing.assert_array_equal(out[1], logits[1])


def test_penalties_change_the_greedy_choice() -> None:
    logits = np.array([[3.0, 2.9, 0.0, -1.0]], dtype=np.float32)
    sampler = Sampler(0)
    assert _run(sampler, logits, [SamplingParams.greedy()]).token_ids[0] == 0
    out = _run(sampler, logits, [SamplingParams.greedy(repetition_penalty=1.2)], prompts=[[0]])
    assert out.token_ids[0] == 1
    # Presence penalty ignores the prompt...
    out = _run(sampler, logits, [SamplingParams.greedy(presence_penalty=0.5)], prompts=[[0]])
    assert out.token_ids[0] == 0
    # ...but not the output.
    out = _run(sampler, logits, [SamplingParams.greedy(presence_penalty=0.5)], outputs=[[0]])
    assert out.token_ids[0] == 1


def test_logprobs_are_raw_log_softmax() -> None:
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((5, 4096)).astype(np.float32) * 3
    params = [
        SamplingParams.greedy(logprobs=5),
        SamplingParams(temperature=0.5, top_k=10, logprobs=0, repetition_penalty=1.5),
        SamplingParams(temperature=2.0, top_p=0.5, logprobs=20),
        SamplingParams(temperature=0.7),
        # A negative frequency penalty raises the chosen token's processed logit by 2.
        SamplingParams.greedy(frequency_penalty=-2.0),
    ]
    top = int(logits[4].argmax())
    outputs = [[], [], [], [], [top]]
    out = _run(Sampler(3), logits, params, prompts=[[1, 2, 3]] * 5, outputs=outputs)
    assert out.token_ids[4] == top
    ref = _log_softmax(logits)
    # float32 log-softmax against float64: one log-sum-exp over the vocabulary, at the logits' scale
    tol = f32_tol(max_abs(logits), logits.shape[1])
    np.testing.assert_allclose(out.logprobs, ref[np.arange(5), out.token_ids], rtol=0, atol=tol)
    assert out.logprobs.dtype == np.float32
    assert out.top_logprobs[1] == [] and out.top_logprobs[3] is None
    for row, n in ((0, 5), (2, 20)):
        top = out.top_logprobs[row]
        assert top is not None and len(top) == n
        ids = [t for t, _ in top]
        np.testing.assert_array_equal(ids, np.argsort(-ref[row], kind="stable")[:n])
        np.testing.assert_allclose([v for _, v in top], ref[row, ids], rtol=0, atol=tol)
        assert all(top[i][1] >= top[i + 1][1] for i in range(n - 1))


@pytest.mark.parametrize("vocab", VOCABS)
def test_banned_ids_never_chosen(vocab: int) -> None:
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((1, vocab)).astype(np.float32)
    # Ban the 5 most likely tokens, which hold most of the mass.
    banned = np.argsort(-logits[0])[:5].tolist()
    logits[0, banned] += 8.0
    rows = 500
    big = np.repeat(logits, rows, axis=0)
    sampler = Sampler(5)
    for params in (
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=8),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams.greedy(),
    ):
        out = _run(sampler, big, [params] * rows, banned=[banned] * rows)
        assert not np.isin(out.token_ids, banned).any(), params
    # The chosen token's logprob is still the raw one.
    np.testing.assert_allclose(out.logprobs[0], _log_softmax(logits)[0, out.token_ids[0]], rtol=0,
                               atol=f32_tol(max_abs(logits), vocab))


def _expected_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Reference for temperature -> top_k -> top_p -> min_p, written the slow, obvious way."""
    probs = _softmax(logits / p.temperature)
    order = np.argsort(-probs, kind="stable")
    keep = np.ones_like(probs, dtype=bool)
    if p.top_k > 0:
        keep[order[p.top_k :]] = False
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    if p.top_p < 1.0:
        # Keep a token while the tokens before it (in order of likelihood) hold < top_p.
        before = np.cumsum(probs[order]) - probs[order]
        probs[order[before >= p.top_p]] = 0.0
        probs /= probs.sum()
    if p.min_p > 0.0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.5, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.9, min_p=0.1),
    ],
    ids=["temperature", "top_k", "top_p", "min_p", "all"],
)
def test_sampled_distribution_matches(params: SamplingParams) -> None:
    logits = np.array([[1.0, 2.0, 0.5, -1.0, 3.0, 0.0, 1.5, -0.5]], dtype=np.float32)
    expected = _expected_probs(logits[0], params)
    rows = 20000
    out = _run(Sampler(1234), np.repeat(logits, rows, axis=0), [params] * rows)
    counts = np.bincount(out.token_ids, minlength=8)
    assert counts[expected == 0].sum() == 0, "a truncated token was sampled"
    stat, dof = _chi_square(counts, expected)
    assert stat < _CHI2_999[dof], (stat, counts, expected)


def test_sampled_distribution_wide_vocab() -> None:
    # Wide rows take the grid inverse-CDF; put the mass on a few tokens spread over the row
    # (different grid columns and rows) and give the rest a tiny, non-zero share.
    vocab = 8192
    logits = np.full((1, vocab), -30.0, dtype=np.float32)
    hot = [0, 17, 511, 4095, 4096, 8191]
    logits[0, hot] = [0.0, 1.0, 0.5, 2.0, -0.5, 1.5]
    expected = _softmax(logits[0])
    rows = 4000
    for params in (SamplingParams(temperature=1.0), SamplingParams(top_p=0.95)):
        out = _run(Sampler(99), np.repeat(logits, rows, axis=0), [params] * rows)
        counts = np.bincount(out.token_ids, minlength=vocab)
        assert counts[hot].sum() == rows
        p = expected[hot] / expected[hot].sum()
        if params.top_p < 1:
            p = _expected_probs(logits[0], params)[hot]
        stat, dof = _chi_square(counts[hot], p)
        assert stat < _CHI2_999[min(dof, 7)], (stat, counts[hot], p)


def test_flat_top_p_falls_back_to_whole_row() -> None:
    # A nearly flat row: the nucleus (about 2900 tokens) is larger than every candidate stage, so
    # the whole-row path decides. Every sample must lie inside the exact nucleus, and the
    # nucleus must be covered fairly evenly.
    vocab = 4096
    logits = np.linspace(0.0, -1.0, vocab, dtype=np.float32)[None, :]
    params = SamplingParams(top_p=0.8)
    expected = _expected_probs(logits[0], params)
    nucleus = np.flatnonzero(expected > 0)
    assert 1024 < nucleus.size < vocab
    rows = 4000
    out = _run(Sampler(7), np.repeat(logits, rows, axis=0), [params] * rows)
    assert np.isin(out.token_ids, nucleus).all()
    # Compare in 8 equal-width buckets of token ids (the mass decreases slowly along the row).
    edges = np.linspace(0, nucleus.max() + 1, 9).astype(int)
    counts = np.histogram(out.token_ids, bins=edges)[0]
    probs = np.add.reduceat(expected[: edges[-1]], edges[:-1])
    stat, dof = _chi_square(counts, probs / probs.sum())
    assert stat < _CHI2_999[dof], (stat, counts)


def _seeded_tokens(
    target_logits: list[np.ndarray],
    params: SamplingParams,
    position: int,
    batch_size: int,
    neighbour_seed: int,
) -> tuple[list[int], list[float]]:
    """Runs one seeded request for several steps at `position` in a batch of random others."""
    rng = np.random.default_rng(neighbour_seed)
    vocab = target_logits[0].shape[0]
    sampler = Sampler(neighbour_seed)
    gen = np.random.default_rng(params.seed)
    neighbours = [
        SamplingParams(temperature=0.9, top_k=7),
        SamplingParams.greedy(),
        SamplingParams(temperature=1.1, top_p=0.5),
        SamplingParams(temperature=0.8, seed=123),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=2000, top_p=0.99),
    ]
    neighbour_gens = {3: np.random.default_rng(123)}
    tokens, logprobs = [], []
    for step_logits in target_logits:
        logits = rng.standard_normal((batch_size, vocab)).astype(np.float32) * 2
        logits[position] = step_logits
        params_list, gens = [], []
        for b in range(batch_size):
            if b == position:
                params_list.append(params)
                gens.append(gen)
            else:
                k = (b + neighbour_seed) % len(neighbours)
                params_list.append(neighbours[k])
                gens.append(neighbour_gens.get(k))
        out = _run(sampler, logits, params_list, gens)
        tokens.append(int(out.token_ids[position]))
        logprobs.append(float(out.logprobs[position]))
    return tokens, logprobs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, seed=42),
        SamplingParams(temperature=0.9, top_k=40, seed=42),
        SamplingParams(temperature=0.9, top_p=0.9, seed=42),
        SamplingParams(temperature=1.0, top_p=0.97, seed=42),
        SamplingParams(temperature=0.9, min_p=0.02, seed=42),
    ],
    ids=["temperature", "top_k", "top_p", "top_p_flat", "min_p"],
)
def test_seeded_request_independent_of_batch(params: SamplingParams) -> None:
    rng = np.random.default_rng(11)
    vocab = 4096
    # Peaked rows (like real logits) and, for "top_p_flat", flat ones that reach the
    # whole-row fallback.
    scale = 1.0 if params.top_p == 0.97 else 4.0
    steps = [rng.standard_normal(vocab).astype(np.float32) * scale for _ in range(12)]
    alone = _seeded_tokens(steps, params, position=0, batch_size=1, neighbour_seed=0)
    for position, batch_size, neighbour_seed in ((3, 7, 1), (0, 5, 2), (6, 7, 3)):
        got = _seeded_tokens(steps, params, position, batch_size, neighbour_seed)
        assert got == alone, (position, batch_size)
    # The seed matters (12 steps colliding by chance is practically impossible).
    other = SamplingParams(**{**params.__dict__, "seed": 43})
    assert _seeded_tokens(steps, other, 0, 1, 0)[0] != alone[0]


def test_shared_generator_reproducible_from_sampler_seed() -> None:
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((32, 1000)).astype(np.float32)
    params = [SamplingParams(temperature=1.0)] * 32
    a = _run(Sampler(8), logits, params).token_ids
    b = _run(Sampler(8), logits, params).token_ids
    c = _run(Sampler(9), logits, params).token_ids
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_input_validation() -> None:
    sampler = Sampler(0)
    logits = np.zeros((2, 10), dtype=np.float32)
    params = [SamplingParams()] * 2
    with pytest.raises(ValueError, match="logits must be"):
        sampler(np.zeros(10), params[:1], [None], [[]], [[]])
    with pytest.raises(ValueError, match="generators has 1 rows"):
        sampler(logits, params, [None], [[], []], [[], []])
    with pytest.raises(ValueError, match="banned_token_ids has 1 rows"):
        sampler(logits, params, [None] * 2, [[], []], [[], []], banned_token_ids=[[1]])
    with pytest.raises(ValueError, match="seed=3 but no generator"):
        sampler(logits, [SamplingParams(seed=3)] * 2, [None] * 2, [[], []], [[], []])
    with pytest.raises(ValueError, match="token id 10 outside"):
        sampler(logits, [SamplingParams(repetition_penalty=1.1)] * 2, [None] * 2,
                [[10], []], [[], []])
    with pytest.raises(ValueError, match="banned_token_ids contains token id -1"):
        sampler(logits, params, [None] * 2, [[], []], [[], []], banned_token_ids=[[-1], []])
    empty = sampler(np.zeros((0, 10), np.float32), [], [], [], [])
    assert empty.token_ids.shape == (0,) and empty.top_logprobs == []


def test_greedy_rows_ignore_seed_generator_and_mix_with_random_rows() -> None:
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((6, 4096)).astype(np.float32) * 5
    gen = np.random.default_rng(1)
    state = gen.bit_generator.state
    params = [SamplingParams.greedy(), SamplingParams(temperature=0.5)] * 3
    out = _run(Sampler(0), logits, params, [gen, None] * 3)
    np.testing.assert_array_equal(out.token_ids[::2], logits[::2].argmax(axis=1))
    # Greedy rows draw nothing, even when handed a generator.
    assert gen.bit_generator.state == state


@pytest.mark.parametrize("width", [3, 4096])
def test_inverse_cdf_edges_never_pick_zero_weight(width: int) -> None:
    from pagedserve.runtime.sample.sampler import _inverse_cdf

    w = np.zeros((3, width), dtype=np.float32)
    w[0, 0] = 1.0  # only the first column has weight
    w[1, : width - 1] = 0.5  # the last column has none
    w[2, 1] = 2.0  # leading zero
    just_below_one = np.nextafter(1.0, 0.0)
    # u * total rounds to the total in float32: the draw must still land on a weighted column.
    for u in (just_below_one, 0.0, 0.5):
        pos = _inverse_cdf(w, np.full(3, u), np)
        assert (w[np.arange(3), pos] > 0).all(), (u, pos)
        assert pos[0] == 0 and pos[2] == 1
    # Wide rows are walked column by column of a [16, W/16] grid, so "last" differs there.
    last = width - 2 if width == 3 else 14 * (width // 16) + width // 16 - 1
    assert _inverse_cdf(w, np.full(3, just_below_one), np)[1] == last


def test_tiny_temperature_and_banned_rows_stay_finite() -> None:
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((4, 4096)).astype(np.float32) * 10
    best = logits.argmax(axis=1)
    params = [SamplingParams(temperature=1e-4), SamplingParams(temperature=1e-4, top_p=0.9)] * 2
    out = _run(Sampler(0), logits, params, banned=[[int(b)] for b in best])
    second = np.argsort(-logits, axis=1)[:, 1]
    np.testing.assert_array_equal(out.token_ids, second)
    assert np.isfinite(out.logprobs).all()


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e308), SamplingParams(temperature=1e308, top_k=5),
                                    SamplingParams(temperature=1e300, min_p=0.5)], ids=["full", "top_k", "min_p"])
def test_huge_temperature_is_uniform_without_overflow(params: SamplingParams) -> None:
    """A huge finite temperature means "uniform over the allowed tokens": no float32 overflow warning, no NaN
    from a banned (-inf) logit over an infinite temperature."""
    from pagedserve.runtime.sample.rejection_sampler import dense_probs

    logits = np.array([[40.0, 2.0, -30.0, 0.5, 7.0, -1.0, 3.0, 11.0]], dtype=np.float32)
    logits[0, 2] = -np.inf  # masked (a grammar, a ban)
    rows = 8000
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "overflow encountered in cast" fails the test
        probs = dense_probs(logits.copy(), [params])[0]
        out = _run(Sampler(7), np.repeat(logits, rows, axis=0), [params] * rows)
    expected = np.full(8, 1 / 7)
    expected[2] = 0.0
    if params.top_k:  # ties at the top: the first k of the (uniform) allowed tokens
        expected = np.where(probs > 0, 1 / params.top_k, 0.0)
    assert np.isfinite(probs).all() and abs(probs.sum() - 1) < 1e-6 and probs[2] == 0
    np.testing.assert_allclose(probs, expected, atol=1e-6)
    counts = np.bincount(out.token_ids, minlength=8)
    assert counts[2] == 0 and np.isfinite(out.logprobs).all()
    if not params.top_k:
        stat, dof = _chi_square(counts, expected)
        assert stat < _CHI2_999[dof], (stat, counts)
    else:
        assert (counts > 0).sum() >= 2  # spread over the kept tokens, not the argmax alone


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -float("inf")])
def test_infinite_or_nan_temperature_is_refused_by_name(bad: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=bad)
