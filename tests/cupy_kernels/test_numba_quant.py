"""GGUF blocks (cupy_kernels/reference/quant.py) and the numba matmul over them (numba_quant.py) against the references.

quant.dequantize must give the gguf package's float32 values bit for bit (pagedserve's float32 weights are
those). The kernel dequantizes each block in registers to those exact values (d q + m, or d q) and adds
w x with one FMA per weight, as the reference's sum_i (d q_i + m) x_i does with rounded products: only the
order of the float32 sums (and the products' rounding) differ. Each term is at most (|d q| + |m|) |x| in
size, so the tolerance is numerics.f32_tol with scale = the largest sum of those magnitudes over an output
(and reduction length = the input size).
"""

from __future__ import annotations

import numpy as np
import pytest
from code_paths import run_as_avx2
from numerics import f32_tol

from pagedserve.cupy_kernels.numba_cpu import gemm as numba_gemm, ops as numba_ops, quant as numba_quant, setup as numba_setup  # noqa: E501
from pagedserve.cupy_kernels.reference import ops, quant

gguf = pytest.importorskip("gguf")

TYPES = ["Q8_0", "Q4_0", "Q4_1"]


def quantized(qtype: str, out: int, inp: int, seed: int):
    """Random float32 [out, in] quantized by the gguf package: (its blocks, its dequantization)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out, inp)) * rng.uniform(0.01, 2.0, (out, 1))).astype(np.float32)
    if out:
        w[0, : min(inp, 40)] = 0.0  # a block of zeros: d = 0 (Q8_0), d = m = 0 (Q4_1)
    t = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, t)
    return raw, gguf.quants.dequantize(raw, t).astype(np.float32)


def weight(qtype: str, raw: np.ndarray) -> quant.QuantWeight:
    arrays = quant.split_blocks(qtype, raw)
    return quant.make_quant_weight(quant.kind_of(qtype), arrays["qs"], arrays["scales"], arrays.get("mins"))


def term_scale(x: np.ndarray, w: quant.QuantWeight) -> float:
    """max over outputs of sum_i (|d q_i| + |m|) |x_i|: the size of the terms either order adds."""
    full = quant.dequantize(w)
    mins = 0.0 if w.mins is None else np.repeat(w.mins, quant.BLOCK, axis=1)
    return float((np.abs(x) @ (np.abs(full - mins) + np.abs(mins)).T).max(initial=0.0))


@pytest.mark.parametrize("qtype", TYPES)
def test_split_blocks_dequantize_bit_for_bit_as_gguf(qtype):
    raw, expected = quantized(qtype, 7, 96, seed=1)
    w = weight(qtype, raw)
    assert w.shape == (7, 96)
    assert not w.qs.flags.writeable and not w.scales.flags.writeable
    np.testing.assert_array_equal(quant.dequantize(w), expected)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 16])
@pytest.mark.parametrize("out,inp", [(1, 32), (37, 64), (130, 576), (19, 1536)])
def test_kernel_matches_the_reference(qtype, rows, out, inp):
    raw, _ = quantized(qtype, out, inp, seed=rows + out)
    w = weight(qtype, raw)
    x = (np.random.default_rng(rows).standard_normal((rows, inp)) * 2).astype(np.float32)
    got = numba_quant.linear(x, w)
    ref = quant.linear(x, w)
    assert got.shape == (rows, out) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=f32_tol(term_scale(x, w), inp))


@pytest.mark.parametrize("qtype", TYPES)
def test_each_row_is_computed_alone(qtype):
    """A row's result does not depend on which other rows share the call (every tile, of whatever height,
    computes it the same way, from the blocks or from an unpacked row): the same bits alone as in a batch of
    1 .. 12 rows (a decode step, a verify step of up to 8 drafts, and more)."""
    raw, _ = quantized(qtype, 50, 160, seed=3)
    w = weight(qtype, raw)
    x = np.random.default_rng(4).standard_normal((12, 160)).astype(np.float32)
    alone = np.stack([numba_quant.linear(x[r : r + 1], w)[0] for r in range(12)])
    for rows in range(1, 13):
        np.testing.assert_array_equal(numba_quant.linear(x[:rows], w), alone[:rows], err_msg=f"{rows} rows")


def test_strided_input_and_bias():
    raw, _ = quantized("Q8_0", 20, 64, seed=5)
    w = weight("Q8_0", raw)
    x = np.random.default_rng(6).standard_normal((3, 128)).astype(np.float32)[:, ::2]  # not contiguous
    bias = np.arange(20, dtype=np.float32)
    got = numba_quant.linear(x, w, bias)
    np.testing.assert_allclose(got, quant.linear(x, w) + bias, rtol=0, atol=f32_tol(term_scale(x, w) + 20, 64))


def test_numba_linear_takes_the_blocks_for_few_rows_and_the_packed_gemm_beyond(monkeypatch):
    raw, dense = quantized("Q4_1", 40, 64, seed=7)
    w = weight("Q4_1", raw)
    packed = numba_gemm.pack(dense)
    rng = np.random.default_rng(8)
    few = rng.standard_normal((numba_quant.QUANT_MAX_ROWS, 64)).astype(np.float32)
    np.testing.assert_array_equal(numba_ops.linear(few, packed, quant=w), numba_quant.linear(few, w))
    many = rng.standard_normal((numba_quant.QUANT_MAX_ROWS + 1, 64)).astype(np.float32)
    np.testing.assert_array_equal(numba_ops.linear(many, packed, quant=w), numba_gemm.matmul(many, packed))
    monkeypatch.setattr(numba_setup, "BATCH_INVARIANT", True)  # then every row count takes the GEMM
    np.testing.assert_array_equal(numba_ops.linear(few, packed, quant=w), numba_gemm.matmul(few, packed))
    # the reference ignores the blocks: its [in, out] weight is their exact value
    weight_t = np.ascontiguousarray(dense.T)
    np.testing.assert_array_equal(ops.linear(few, weight_t, quant=w), ops.linear(few, weight_t))


def test_concat_rows_fuses_in_order():
    parts = [weight("Q4_1", quantized("Q4_1", n, 64, seed=n)[0]) for n in (3, 5)]
    fused = quant.concat_rows(parts)
    np.testing.assert_array_equal(quant.dequantize(fused), np.concatenate([quant.dequantize(p) for p in parts]))
    with pytest.raises(ValueError, match="cannot fuse"):
        quant.concat_rows([parts[0], weight("Q8_0", quantized("Q8_0", 2, 64, seed=9)[0])])


def test_bad_shapes_raise_value_errors():
    raw, _ = quantized("Q4_1", 4, 64, seed=10)
    w = weight("Q4_1", raw)
    with pytest.raises(ValueError, match="input of shape"):
        numba_quant.linear(np.ones((2, 32), np.float32), w)
    with pytest.raises(ValueError, match="Q4_1 blocks must be"):
        quant.split_blocks("Q4_1", raw[:, :-1])
    with pytest.raises(ValueError, match="not one of"):
        quant.split_blocks("Q5_K", raw)
    with pytest.raises(ValueError, match="do not fit"):
        quant.make_quant_weight("q4", w.qs[:, :-1], w.scales, w.mins)
    with pytest.raises(ValueError, match="need mins"):
        quant.make_quant_weight("q4", w.qs, w.scales, None)


AVX2_CHECK = """
import numpy as np
from numerics import f32_tol
from pagedserve.cupy_kernels.numba_cpu import gemm as numba_gemm, quant as numba_quant
from pagedserve.cupy_kernels.reference import quant
assert not numba_gemm.AVX512 and numba_quant._BUFFERED, numba_quant._TILE
assert (numba_quant._TILE, numba_quant._BUFFER_TILE) == (2, 3)
rng = np.random.default_rng(0)
for kind in ("q4", "q8"):
    out, inp = 37, 96
    qs = (rng.integers(0, 256, (out, inp // 2), dtype=np.uint8) if kind == "q4"
          else rng.integers(-128, 128, (out, inp), dtype=np.int8))
    scales = rng.uniform(-0.1, 0.1, (out, inp // 32)).astype(np.float16).astype(np.float32)
    mins = rng.uniform(-1, 1, (out, inp // 32)).astype(np.float16).astype(np.float32) if kind == "q4" else None
    w = quant.make_quant_weight(kind, qs, scales, mins)
    full = quant.dequantize(w)
    for rows in range(12):  # 2 rows from the blocks; more: 2 that unpack the row once, then 3 at a time from it
        x = rng.standard_normal((rows, inp)).astype(np.float32)
        got = numba_quant.linear(x, w)
        scale = float((np.abs(x) @ np.abs(full).T).max(initial=0.0))
        assert np.abs(got - x @ full.T).max(initial=0.0) <= f32_tol(scale, inp), (kind, rows)
        for r in range(rows):
            assert np.array_equal(numba_quant.linear(x[r : r + 1], w)[0], got[r]), (kind, rows, r)
print("OK")
"""


def test_without_avx512_the_kernel_converts_quants_and_unpacks_each_weight_row_once(tmp_path):
    """AVX2 code (NUMBA_CPU_FEATURES without AVX-512) has no vpermps table lookup: the quants go through
    int-to-float conversions, and 2 rows a pass that unpacks keep the accumulators in 16 registers; with more
    rows that pass stores the unpacked weight row and passes of 3 rows read it. Results stay right, a row the
    same bits alone as in a batch."""
    proc = run_as_avx2(AVX2_CHECK, tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-2000:]
