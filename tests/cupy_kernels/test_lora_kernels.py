"""Batched LoRA shrink/expand: the numpy reference against the plain per-row math, numba against the reference."""

from __future__ import annotations

import numpy as np
import pytest

from numerics import f32_tol
from pagedserve.cupy_kernels.reference import lora as ref


def _case(seed=0, T=37, L=4, R=16, n_in=48, n_out=40, base_every=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    a = rng.standard_normal((L, R, n_in)).astype(np.float32)
    b = rng.standard_normal((L, n_out, R)).astype(np.float32)
    a[1, 8:] = 0  # slot 1: rank 8, zero-padded to R
    b[1, :, 8:] = 0
    scale = rng.uniform(0.5, 2.0, L).astype(np.float32)
    slots = rng.integers(0, L, T).astype(np.int32)
    slots[::base_every] = -1
    slots[10:20] = 2  # a prefill-like run of one adapter
    y = rng.standard_normal((T, n_out)).astype(np.float32)
    return x, a, b, scale, slots, y


def _per_row(x, a, b, scale, slots, y):
    out = y.astype(np.float64).copy()
    for i, s in enumerate(slots):
        if s >= 0:
            out[i] += scale[s] * (b[s].astype(np.float64) @ (a[s].astype(np.float64) @ x[i]))
    return out


@pytest.mark.parametrize("gather_max", [ref.GATHER_MAX_FLOATS, 0])  # gathered, and segmented over runs
def test_reference_matches_per_row_math(monkeypatch, gather_max):
    monkeypatch.setattr(ref, "GATHER_MAX_FLOATS", gather_max)
    x, a, b, scale, slots, y = _case()
    want = _per_row(x, a, b, scale, slots, y)
    got = ref.lora_expand(ref.lora_shrink(x, a, slots), b, scale, slots, y.copy())
    tol = f32_tol(np.abs(want).max(), 48 * 16, 2)
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)
    base = slots < 0
    np.testing.assert_array_equal(got[base], y[base])  # base rows untouched, bit for bit


def test_all_base_rows_are_a_no_op():
    x, a, b, scale, slots, y = _case()
    slots[:] = -1
    t = ref.lora_shrink(x, a, slots)
    assert not t.any()
    np.testing.assert_array_equal(ref.lora_expand(t, b, scale, slots, y.copy()), y)


def test_numba_matches_reference():
    from pagedserve.cupy_kernels.numba_cpu import lora as nb

    for T in (5, 130):  # one thread, and rows over numba's threads
        x, a, b, scale, slots, y = _case(seed=T, T=T)
        want = ref.lora_expand(ref.lora_shrink(x, a, slots), b, scale, slots, y.copy())
        t = nb.lora_shrink(x, a, slots)
        np.testing.assert_allclose(t, ref.lora_shrink(x, a, slots), atol=f32_tol(np.abs(t).max(), 48), rtol=0)
        got = nb.lora_expand(t, b, scale, slots, y.copy())
        np.testing.assert_allclose(got, want, atol=f32_tol(np.abs(want).max(), 48 * 16, 2), rtol=0)
        base = slots < 0
        np.testing.assert_array_equal(got[base], y[base])


def test_kernel_sets_have_the_lora_ops():
    from pagedserve.cupy_kernels.kernel_set import cpu_kernels

    for name in ("numpy", "numba"):
        ks = cpu_kernels(name)
        assert ks.lora_shrink is not None and ks.lora_expand is not None
