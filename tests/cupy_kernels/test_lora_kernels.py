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
    b = rng.standard_normal((L, R, n_out)).astype(np.float32)  # B transposed: [R, out] a slot
    a[1, 8:] = 0  # slot 1: rank 8, zero-padded to R
    b[1, 8:] = 0
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
            out[i] += scale[s] * ((a[s].astype(np.float64) @ x[i]) @ b[s].astype(np.float64))
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


def _fused_case(seed=3, T=70, L=3, R=8, n_in=40, outs=(24, 8, 8)):
    """A fused q/k/v-like projection: slot 0 targets every part at rank 8, slot 1 only q and v at rank 5 (its k
    block and the padding zero), slot 2 nothing but v at rank 3."""
    rng = np.random.default_rng(seed)
    bounds = np.concatenate(([0], np.cumsum(outs))).astype(np.int32)
    parts = len(outs)
    ranks = np.array([[R] * parts, [5, 0, 5], [0, 0, 3]], dtype=np.int32)[:L]
    a = np.zeros((L, parts * R, n_in), dtype=np.float32)
    b = np.zeros((L, parts * R, bounds[-1]), dtype=np.float32)
    for s in range(L):
        for p in range(parts):
            r = ranks[s, p]
            a[s, p * R:p * R + r] = rng.standard_normal((r, n_in))
            b[s, p * R:p * R + r, bounds[p]:bounds[p + 1]] = rng.standard_normal((r, outs[p]))
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    slots = rng.integers(-1, L, T).astype(np.int32)
    y = rng.standard_normal((T, bounds[-1])).astype(np.float32)
    return x, a, b, rng.uniform(0.5, 2.0, L).astype(np.float32), slots, y, ranks, bounds


def test_numba_skips_untargeted_parts_and_padding_with_the_same_result():
    """With ranks and bounds the numba items skip the zero blocks (a q/v-only adapter's k, the rank's padding):
    the same sums as the reference's over the zeros. The skip is real: garbage written into a skipped block of A
    and B does not reach the output (it would without ranks)."""
    from pagedserve.cupy_kernels.numba_cpu import lora as nb

    for T in (5, 70):  # one thread, and rows over numba's threads
        x, a, b, scale, slots, y, ranks, bounds = _fused_case(T=T)
        want = ref.lora_expand(ref.lora_shrink(x, a, slots), b, scale, slots, y.copy())
        a[1, 8:16], b[1, 8:16] = 1e6, 1e6  # slot 1's untargeted k part
        a[2, 3:8], b[2, :, 0] = 1e6, 1e6  # slot 2's q part (rank 0) and padding
        t = nb.lora_shrink(x, a, slots, ranks)
        got = nb.lora_expand(t, b, scale, slots, y.copy(), ranks, bounds)
        np.testing.assert_allclose(got, want, atol=f32_tol(np.abs(want).max(), 40 * 8, 2), rtol=0)
        unskipped = nb.lora_expand(nb.lora_shrink(x, a, slots), b, scale, slots, y.copy())
        assert np.abs(unskipped - want).max() > 1e3  # the garbage is there to be skipped


def test_gated_weight_plain_product_has_matmuls_bits():
    """ops.linear on a gated gate_up (the LoRA step's path, base-only steps keep the fused SiLU) gives [gate | up]
    in order, bit for bit the plain GEMM of the unpacked weight, and silu_and_mul of it the fused op's bits."""
    from pagedserve.cupy_kernels.numba_cpu import gemm, ops as nops

    rng = np.random.default_rng(5)
    for inter, rows in ((40, 3), (64, 30)):  # a padded last panel, and whole panels
        gate, up = (rng.standard_normal((inter, 24)).astype(np.float32) for _ in range(2))
        x = rng.standard_normal((rows, 24)).astype(np.float32)
        gated = nops.pack_weight([gate, up], gated=True)
        got = nops.linear(x, gated)
        want = gemm.matmul(x, gemm.pack_rows([gate, up]))
        assert got.shape == (rows, 2 * inter)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(nops.silu_and_mul(got), nops.linear_silu_and_mul(x, gated))


def test_kernel_sets_have_the_lora_ops():
    from pagedserve.cupy_kernels.kernel_set import cpu_kernels

    for name in ("numpy", "numba"):
        ks = cpu_kernels(name)
        assert ks.lora_shrink is not None and ks.lora_expand is not None
