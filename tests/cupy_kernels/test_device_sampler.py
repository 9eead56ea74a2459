"""The sort-free device sampler (sampling.cu's sample_rows_kernel, cuda ops.sample_rows) without a GPU.

The kernel runs on the host emulation (test_kernels_on_host.py's harness, the sampling module alone), and is
checked token for token against its numpy reference (reference/sample_rows.py), whose rules are checked
against the distribution they define (kept_probabilities, by sorting); the kernel's samples pass a
chi-square test against that distribution (tests/chi_square.py). On a device: the GPU test at the end.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from chi_square import goodness_of_fit
from pagedserve.cupy_kernels.cuda import launch as cuda_launch, modules as cuda_modules, ops as cuda_ops
from pagedserve.cupy_kernels.reference import sample_rows as ref

# The host emulation's harness: test_kernels_on_host.py's helpers, loaded by path (tests/cupy_kernels is no package).
_spec = importlib.util.spec_from_file_location("pagedserve_host_emulation_helpers",
                                               Path(__file__).with_name("test_kernels_on_host.py"))
_host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_host)
GXX, _build, _dev, fake_cupy, load = _host.GXX, _host._build, _host._dev, _host.fake_cupy, _host.load

# (temperature, top_k, top_p, min_p): each mode alone and mixed
MODES = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.3, 0, 1.0, 0.05), (0.8, 20, 0.9, 0.02),
         (1.0, 1, 1.0, 0.0), (0.5, 0, 0.3, 0.1), (2.0, 200, 0.95, 0.0)]


def _params(modes, reps=1):
    t, k, p, m = (np.array([md[i] for md in modes for _ in range(reps)]) for i in range(4))
    return t.astype(np.float32), k.astype(np.int32), p.astype(np.float32), m.astype(np.float32)


def _logits(rows, vocab, seed, dtype=np.float32):
    x = (np.random.default_rng(seed).standard_normal((rows, vocab)) * 2.5).astype(dtype)
    return x


# ---------------------------------------------------------------------------------------------
# The reference against the distribution its rules define
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_reference_draws_are_the_inverse_cdf_of_the_kept_distribution(mode):
    x = _logits(1, 300, seed=int(mode[1] * 7 + mode[2] * 100))[0]
    x[[10, 20, 30, 40, 50]] = x.max() + 0.5  # a tie group at the top: top-k 1 and 5 cut inside it
    x[7] = -np.inf  # a banned token
    temp, k, p, m = mode
    probs = ref.kept_probabilities(x, temp, k, p, m)
    assert probs[7] == 0 and probs.sum() == pytest.approx(1.0)
    if k in (1, 5):
        assert np.flatnonzero(probs).tolist() == [10, 20, 30, 40, 50][:k]  # ties: lowest ids first
    us = np.linspace(0, 1, 97, endpoint=False) + 0.003
    got = ref.sample_rows(np.repeat(x[None], len(us), 0), *_params([mode], len(us)), us)
    cdf = np.cumsum(probs)
    want = np.minimum(np.searchsorted(cdf, us, side="right"), np.flatnonzero(probs).max())
    np.testing.assert_array_equal(got, want)


def test_kary_search_finds_the_largest_good_value():
    for target in (-1, 0, 1, 17, 2**31 - 5):
        assert ref.kary_search(-1, 2**31, lambda p: p <= target) == target
    assert ref.kary_search(5, 5, lambda p: p <= 0) == 5


# ---------------------------------------------------------------------------------------------
# The kernel on the host emulation
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampling_lib(tmp_path_factory):
    if GXX is None:
        pytest.skip("g++ not found (needed to run the kernels on the CPU)")
    path = _build(cuda_modules.MODULES["sampling"], tmp_path_factory.mktemp("sampling_emulation"))
    return load(path)


@pytest.fixture
def emulated_sampling(sampling_lib, monkeypatch):
    cp = fake_cupy({"sampling": sampling_lib})
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", "0")
    monkeypatch.setattr(cuda_modules, "_modules", {})
    monkeypatch.setattr(cuda_modules, "_functions", {})
    monkeypatch.setattr(cuda_launch, "_dummies", {})
    return cp


# top-k sets of at most PS_CANDIDATES (2048) tokens move to shared memory; larger ones stay in the row
BIG_K_MODES = [(1.0, 2100, 1.0, 0.0), (0.9, 2600, 0.9, 0.0), (1.1, 3000, 1.0, 0.001)]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("vocab", [37, 300, 2000, 3200])
def test_kernel_matches_the_reference_token_for_token(emulated_sampling, dtype, vocab):
    reps = 3
    temp, k, p, m = _params(MODES + (BIG_K_MODES if vocab > 3000 else []), reps)
    rows = len(temp)
    x = _logits(rows, vocab, seed=vocab, dtype=dtype)
    x[0::5, :7] = x[0::5].max(axis=1, keepdims=True)  # ties at the top
    x[1::4, 3] = -np.inf
    k = np.minimum(k, vocab + 3)  # k >= V: off
    u = np.random.default_rng(vocab + 1).random(rows)
    got = cuda_ops.sample_rows(_dev(x), temp, k, p, m, u).get()
    want = ref.sample_rows(x, temp, k, p, m, u)
    np.testing.assert_array_equal(got, want)
    by_value = (np.arange(rows) % 2).astype(np.int32)  # every other row draws in value order
    got_v = cuda_ops.sample_rows(_dev(x), temp, k, p, m, u, by_value).get()
    np.testing.assert_array_equal(got_v, ref.sample_rows(x, temp, k, p, m, u, by_value))
    assert (got_v[by_value == 0] == got[by_value == 0]).all() and (got_v != got).any()


def test_value_order_draws_the_host_samplers_token_for_top_k_rows(emulated_sampling):
    """A top-k row in value order draws what Sampler's host path draws from the same uniform (its candidates
    sorted most likely first), so a seeded request gets the same token on the CPU and the GPU."""
    from pagedserve.runtime.sample.sampler import Sampler

    x = _logits(6, 500, seed=4)
    modes = [(0.8, 40, 1.0, 0.0), (1.0, 7, 1.0, 0.0), (1.0, 100, 0.8, 0.0), (0.6, 50, 1.0, 0.05),
             (1.0, 3, 1.0, 0.0), (1.5, 400, 0.95, 0.01)]
    temp, k, p, m = _params(modes)
    u = np.random.default_rng(8).random(6)
    got = cuda_ops.sample_rows(_dev(x), temp, k, p, m, u, np.ones(6, np.int32)).get()
    for b in range(6):
        ids, vals = _host_candidates(x[b:b + 1] / temp[b], int(k[b]))
        w = np.exp(vals - vals[:, :1])
        tok = Sampler._sample_candidates(ids, w, w.sum(axis=1), p[b:b + 1], p[b] < 1, m[b:b + 1], m[b] > 0,
                                         u[b:b + 1], np)
        assert got[b] == tok[0], (b, got[b], tok[0])


def _host_candidates(scaled, k):
    from pagedserve.runtime.sample.sampling_ops import _top_candidates

    return _top_candidates(scaled.astype(np.float32), k, np)


def test_kernel_uses_each_rows_own_parameters_and_writes_into_out(emulated_sampling):
    x = _logits(4, 64, seed=3)
    temp, k, p, m = _params([(1.0, 1, 1.0, 0.0), (1.0, 0, 1.0, 0.0)] * 2)
    out = _dev(np.full(4, -7, np.int64))
    got = cuda_ops.sample_rows(_dev(x), temp, k, p, m, np.array([0.1, 0.99, 0.5, 0.0]), out=out)
    assert got is out
    assert got[0] == x[0].argmax() and got[2] == x[2].argmax()  # top-k 1 is greedy whatever u
    np.testing.assert_array_equal(got.get(), ref.sample_rows(x, temp, k, p, m, [0.1, 0.99, 0.5, 0.0]))


def test_bad_arguments_name_the_field(emulated_sampling):
    x = _dev(_logits(2, 16, 0))
    temp, k, p, m = _params(MODES[:2])
    with pytest.raises(ValueError, match="top_k has shape \\(3,\\), expected \\(2,\\)"):
        cuda_ops.sample_rows(x, temp, np.zeros(3, np.int32), p, m, np.zeros(2))
    with pytest.raises(ValueError, match="logits must be \\[B, V\\]"):
        cuda_ops.sample_rows(_dev(np.zeros(5, np.float32)), temp, k, p, m, np.zeros(2))
    with pytest.raises(ValueError, match="dtype int64 is not supported"):
        cuda_ops.sample_rows(_dev(np.zeros((2, 4), np.int64)), temp, k, p, m, np.zeros(2))


@pytest.mark.slow
@pytest.mark.parametrize("mode", [(0.7, 12, 0.9, 0.02), (1.0, 0, 0.85, 0.0), (1.2, 0, 1.0, 0.03)])
def test_kernel_samples_pass_chi_square_against_the_kept_distribution(emulated_sampling, mode):
    """1,500 draws of one row (a launch of 1,500 identical rows, each with its own uniform)."""
    n, vocab = 1500, 48
    row = _logits(1, vocab, seed=int(mode[2] * 1000))[0]
    temp, k, p, m = _params([mode], n)
    u = np.random.default_rng(42).random(n)
    by_value = (np.arange(n) % 2).astype(np.int32)  # half the draws in value order: one distribution either way
    got = cuda_ops.sample_rows(_dev(np.repeat(row[None], n, 0)), temp, k, p, m, u, by_value).get()
    probs = ref.kept_probabilities(row, *mode)
    counts = np.bincount(got, minlength=vocab)
    assert counts[probs == 0].sum() == 0
    stat, df, pvalue = goodness_of_fit(counts, probs)
    assert df >= 3 and pvalue > 1e-3, (stat, df, pvalue)


# ---------------------------------------------------------------------------------------------
# On a device
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_kernel_on_gpu_matches_the_reference_and_passes_chi_square():
    import cupy as cp

    temp, k, p, m = _params(MODES, 4)
    x = _logits(len(temp), 128256 // 8, seed=5)
    u = np.random.default_rng(6).random(len(temp))
    got = cuda_ops.sample_rows(cp.asarray(x), temp, k, p, m, u).get()
    want = ref.sample_rows(x, temp, k, p, m, u)
    # expf on the device and float32 sums may move a draw that lands within rounding of a boundary
    assert (got != want).sum() <= 1, np.flatnonzero(got != want)
    n, vocab, mode = 20000, 1000, (0.8, 50, 0.9, 0.01)
    row = _logits(1, vocab, seed=9)[0]
    tn, kn, pn, mn = _params([mode], n)
    draws = cuda_ops.sample_rows(cp.asarray(np.repeat(row[None], n, 0)), tn, kn, pn, mn,
                                 np.random.default_rng(1).random(n)).get()
    probs = ref.kept_probabilities(row, *mode)
    assert goodness_of_fit(np.bincount(draws, minlength=vocab), probs)[2] > 1e-3


def _sampler_xp(cp):
    from pagedserve.runtime.engine.model_runner import _DeviceArrayModule

    cp.__getattr__ = lambda name: getattr(np, name)  # the sampler's other array calls: numpy on the stand-in arrays
    return _DeviceArrayModule(cp)


def test_sampler_on_device_arrays_matches_the_host_path_through_the_kernel(emulated_sampling, monkeypatch):
    """The GPU suite's sampler check (gpu_helpers: greedy, top-k, top-p, min-p, penalties, a ban, logprobs),
    on the emulated kernel: the random rows go through one sample_rows launch, which draws the host path's
    tokens where both walk the same order and top-p draws inside the nucleus; one read-back."""
    import gpu_helpers
    from pagedserve.runtime.sample import sampling_device

    calls, fetches = [], []
    real_sample, real_fetch = cuda_ops.sample_rows, sampling_device.fetch
    monkeypatch.setattr(cuda_ops, "sample_rows", lambda *a, **k: calls.append(a[0].shape) or real_sample(*a, **k))
    monkeypatch.setattr(sampling_device, "fetch", lambda parts, xp: fetches.append(len(parts)) or real_fetch(parts, xp))
    params = gpu_helpers.sampler_params()
    logits = gpu_helpers.sampler_logits(len(params), 3000, seed=11)
    dev = gpu_helpers.run_sampler(_sampler_xp(emulated_sampling), _dev(logits), params)
    monkeypatch.setattr(sampling_device, "fetch", real_fetch)
    host = gpu_helpers.run_sampler(np, logits, params)
    assert calls == [(7, 3000)] and len(fetches) == 1  # the 7 random rows in one launch; one transfer
    gpu_helpers.check_device_tokens_against_host(dev, host, logits, params)


def test_an_all_random_batch_writes_the_kernels_tokens_in_place(emulated_sampling):
    from pagedserve.runtime.sample.sampler import Sampler
    from pagedserve.runtime.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.9, top_k=k, seed=s) for s, k in ((1, 5), (2, 50), (3, 1))]
    logits = _logits(3, 700, seed=2)
    gens = [np.random.default_rng(p.seed) for p in params]
    out = Sampler(0)(_dev(logits), params, gens, [[]] * 3, [[]] * 3, xp=_sampler_xp(emulated_sampling))
    host = Sampler(0)(logits, params, [np.random.default_rng(p.seed) for p in params], [[]] * 3, [[]] * 3)
    np.testing.assert_array_equal(out.token_ids, host.token_ids)
    assert out.token_ids[2] == logits[2].argmax()


def test_huge_temperature_reaches_the_kernel_finite(emulated_sampling):
    """temperature 1e308 (finite, a valid request) goes to the kernel as MAX_TEMPERATURE, not as a float32 inf
    (numpy's "overflow encountered in cast", then -inf / inf = NaN on a banned token): uniform over the allowed."""
    import warnings

    from pagedserve.runtime.sample import sampling_device
    from pagedserve.runtime.sampling_params import MAX_TEMPERATURE, SamplingParams

    rows, vocab = 400, 37
    x = np.repeat(_logits(1, vocab, seed=5) * 8, rows, 0)
    x[:, 7] = -np.inf
    params = [SamplingParams(temperature=1e308)] * rows
    u = np.random.default_rng(2).random(rows)
    tokens = _dev(np.zeros(rows, np.int64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sampling_device.sample_random_rows(_dev(x), params, list(range(rows)), u, tokens, np)
    got = np.asarray(tokens.view(np.ndarray))
    want = ref.sample_rows(x, np.full(rows, MAX_TEMPERATURE, np.float32), np.zeros(rows, np.int32),
                           np.ones(rows, np.float32), np.zeros(rows, np.float32), u)
    np.testing.assert_array_equal(got, want)
    probs = ref.kept_probabilities(x[0], np.float32(MAX_TEMPERATURE), 0, 1.0, 0.0)
    assert np.isfinite(probs).all() and probs.sum() == pytest.approx(1.0) and probs[7] == 0
    np.testing.assert_allclose(probs[np.arange(vocab) != 7], 1 / (vocab - 1), rtol=1e-6)
    assert 7 not in got and goodness_of_fit(np.bincount(got, minlength=vocab), probs)[2] > 1e-3
