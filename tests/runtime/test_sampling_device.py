"""The sampler's device path (runtime/sample/sampling_device.py), run with numpy standing in for CuPy.

`StrictXp` hands out arrays that refuse every implicit host conversion (bool, int, float, item,
tolist) and count `.get()`, the explicit device->host copy: the device path must read back once per
step and make no data-dependent decision on the host. The sampler cases are tests/gpu_helpers.py's,
shared with the same check on real CuPy arrays (tests/cupy_kernels/test_gpu_runtime.py).
"""

from __future__ import annotations

import numpy as np
import pytest

import gpu_helpers
from gpu_helpers import SAME_ORDER_ROWS
from gpu_helpers import sampler_logits as _logits
from pagedserve.runtime.sample import sampling_device
from pagedserve.runtime.sample.sampling_ops import _first_above, _top_candidates


class DeviceArray(np.ndarray):
    gets = 0

    def __array_wrap__(self, arr, context=None, return_scalar=False):
        return np.asarray(arr).view(DeviceArray)  # reductions stay arrays: no silent host scalars

    def _sync(self, *args, **kwargs):
        raise AssertionError("a host sync: a device value was read implicitly")

    __bool__ = __int__ = __float__ = __index__ = item = tolist = _sync

    def get(self):
        DeviceArray.gets += 1
        return np.array(np.asarray(self))


class StrictXp:
    """numpy's functions, returning DeviceArray."""

    def __getattr__(self, name):
        f = getattr(np, name)
        if isinstance(f, type) or not callable(f):
            return f

        def wrapped(*args, **kwargs):
            out = f(*args, **kwargs)
            if isinstance(out, tuple):
                return tuple(o.view(DeviceArray) if isinstance(o, np.ndarray) else o for o in out)
            return out.view(DeviceArray) if isinstance(out, np.ndarray) else out

        return wrapped

    def asarray(self, a, dtype=None):
        return np.array(np.asarray(a), dtype=dtype).view(DeviceArray)

    def argsort(self, a, axis=-1):  # CuPy's argsort is always stable and takes no `kind`
        return np.argsort(a, axis=axis, kind="stable").view(DeviceArray)


XP = StrictXp()


@pytest.mark.parametrize("c", [1, 5, 64, 1024, 2000])
def test_top_candidates_without_sorting_rows_match_the_host_selection(c):
    x = _logits(6, 5000, seed=c)
    x[2, [10, 20, 30, 40]] = x[2].max() + 1  # ties at the top: lowest ids first
    x[3, :] = 0.5  # a whole row of ties
    x[4, 100] = -np.inf
    ids, vals = _top_candidates(XP.asarray(x), c, XP)
    ref_ids, ref_vals = _top_candidates(x, c, np)
    np.testing.assert_array_equal(np.asarray(vals), ref_vals)
    untied = [0, 1, 4, 5]
    np.testing.assert_array_equal(np.asarray(ids)[untied], ref_ids[untied])
    np.testing.assert_array_equal(np.asarray(ids)[3], np.arange(c))  # ties: token order
    assert list(np.asarray(ids)[2, :4]) == ([10, 20, 30, 40][:c] if c < 4 else [10, 20, 30, 40])


def test_sortable_keys_order_like_the_floats():
    v = np.array([[-np.inf, -3e38, -1.0, -1e-40, -0.0, 0.0, 1e-40, 2.0, 3e38, np.inf]], dtype=np.float32)
    keys = np.asarray(sampling_device.sortable_keys(v, np))
    assert (np.diff(keys[0]) >= 0).all() and keys[0, 4] < keys[0, 5]


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_nucleus_by_bisection_keeps_what_the_sorted_rule_keeps(top_p):
    x = _logits(8, 3000, seed=int(top_p * 1000))
    x[5, :40] = x[5].max()  # a tie group at the top
    keep, _ = sampling_device.nucleus_mask(XP.asarray(x), XP.asarray(np.full(8, top_p, np.float32)), XP)
    # The sorted formulation of Sampler._sample_nucleus_full_row.
    asc = np.sort(x, axis=1)
    cs = np.cumsum(np.exp(asc - asc[:, -1:]), axis=1)
    num_drop = (cs <= cs[:, -1:] * (1 - top_p)).sum(axis=1)
    cutoff = asc[np.arange(8), np.minimum(num_drop, 2999)]
    ref = x >= cutoff[:, None]
    got = np.asarray(keep)
    # Summation order differs (cumsum vs masked sums): at most the one boundary value may flip.
    assert (got != ref).sum(axis=1).max() <= 1
    assert got[np.arange(8), x.argmax(axis=1)].all()  # the most likely token is always kept


def test_first_above_needs_no_branch_on_the_host():
    cs = np.cumsum(np.array([[0.0, 1.0, 0.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]], np.float32), axis=1)
    targets = np.array([3.0, 2.5], np.float32)  # row 0: at its total (rounding): the last column with weight
    got = _first_above(XP.asarray(cs), XP.asarray(targets), XP)
    np.testing.assert_array_equal(np.asarray(got), _first_above(cs, targets, np))
    np.testing.assert_array_equal(np.asarray(got), [3, 2])


def test_one_read_back_per_step_and_the_host_paths_tokens():
    params = gpu_helpers.sampler_params()
    logits = _logits(len(params), 8192, seed=11)
    DeviceArray.gets = 0
    dev = gpu_helpers.run_sampler(XP, XP.asarray(logits), params)
    assert DeviceArray.gets == 1
    host = gpu_helpers.run_sampler(np, logits, params)
    # greedy, top-k and whole-row draws walk the same order on both paths; top-p rows draw in token order
    # on the device (in probability order on the host), inside the same nucleus
    gpu_helpers.check_device_tokens_against_host(dev, host, logits, params)
    same = SAME_ORDER_ROWS
    np.testing.assert_allclose(dev.logprobs, np.asarray(dev.logprobs), rtol=0)
    np.testing.assert_allclose(dev.logprobs[same], host.logprobs[same], rtol=1e-6, atol=1e-6)
    assert dev.top_logprobs[1] is None and dev.top_logprobs[2] == []
    for b in (0, 3):
        assert [t for t, _ in dev.top_logprobs[b]] == [t for t, _ in host.top_logprobs[b]]
        np.testing.assert_allclose([v for _, v in dev.top_logprobs[b]], [v for _, v in host.top_logprobs[b]],
                                   rtol=1e-6, atol=1e-6)
