"""GGUF k-quants (cupy_kernels/reference/quant.py's dequantize_kquant).

Two independent checks:
- blocks packed here from chosen scales, mins and quants, byte by byte as llama.cpp's block_q*_K layout says
  (ggml-common.h; a packer written from the layout, no quantizer), dequantize to d * scale * q - dmin * min;
- random bytes dequantize bit for bit as the gguf package's `gguf.quants.dequantize` does (an oracle
  written separately from ours).
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.cupy_kernels.reference.quant import KQUANT_BLOCK_BYTES, QK_K, dequantize_kquant


def _f16_bytes(x: float) -> list[int]:
    return list(np.array([x], dtype="<f2").view(np.uint8))


def _pack_scale_min_k4(scales: list[int], mins: list[int]) -> list[int]:
    """8 6-bit scales and 8 6-bit mins -> the 12 bytes of Q4_K/Q5_K (get_scale_min_k4 read backwards)."""
    out = [0] * 12
    for j in range(4):
        out[j] = (scales[j] & 63) | ((scales[j + 4] >> 4) << 6)
        out[j + 4] = (mins[j] & 63) | ((mins[j + 4] >> 4) << 6)
        out[j + 8] = (scales[j + 4] & 15) | ((mins[j + 4] & 15) << 4)
    return out


def _pack_q4_k(d: float, dmin: float, scales, mins, q) -> np.ndarray:
    """q: 256 values 0..15 in weight order; weight 64 j + l (l < 32) is qs[32 j + l]'s low nibble, 64 j + 32 + l
    its high nibble."""
    qs = [0] * 128
    for j in range(4):
        for lane in range(32):
            qs[32 * j + lane] = q[64 * j + lane] | (q[64 * j + 32 + lane] << 4)
    return np.array(_f16_bytes(d) + _f16_bytes(dmin) + _pack_scale_min_k4(scales, mins) + qs, dtype=np.uint8)


def _pack_q5_k(d: float, dmin: float, scales, mins, q) -> np.ndarray:
    """q: 256 values 0..31; the low 4 bits as Q4_K, bit 4 of weight 32 s + l in qh[l] bit s."""
    qs = [0] * 128
    qh = [0] * 32
    for j in range(4):
        for lane in range(32):
            qs[32 * j + lane] = (q[64 * j + lane] & 15) | ((q[64 * j + 32 + lane] & 15) << 4)
    for s in range(8):
        for lane in range(32):
            qh[lane] |= (q[32 * s + lane] >> 4) << s
    return np.array(_f16_bytes(d) + _f16_bytes(dmin) + _pack_scale_min_k4(scales, mins) + qh + qs, dtype=np.uint8)


def _pack_q6_k(d: float, scales, q) -> np.ndarray:
    """q: 256 values 0..63 (the weight is d * scale * (q - 32)); per half of 128, weight 32 k + l takes ql byte
    (l + 32 * (k % 2)), nibble k // 2, and bits 2 k .. 2 k + 1 of qh byte l."""
    ql = [0] * 128
    qh = [0] * 64
    for half in range(2):
        for k in range(4):
            for lane in range(32):
                v = q[128 * half + 32 * k + lane]
                ql[64 * half + 32 * (k % 2) + lane] |= (v & 15) << (4 * (k // 2))
                qh[32 * half + lane] |= (v >> 4) << (2 * k)
    sc = list(np.array(scales, dtype=np.int8).view(np.uint8))
    return np.array(ql + qh + sc + _f16_bytes(d), dtype=np.uint8)


def _pack_q2_k(d: float, dmin: float, scales, mins, q) -> np.ndarray:
    """q: 256 values 0..3, 16 4-bit scales and mins (one per 16 weights); per half of 128, weight 32 k + 16 g + l
    sits in qs byte 16 g + l at shift 2 k."""
    qs = [0] * 64
    for half in range(2):
        for k in range(4):
            for g in range(2):
                for lane in range(16):
                    qs[32 * half + 16 * g + lane] |= q[128 * half + 32 * k + 16 * g + lane] << (2 * k)
    packed = [(s & 15) | ((m & 15) << 4) for s, m in zip(scales, mins)]
    return np.array(packed + qs + _f16_bytes(d) + _f16_bytes(dmin), dtype=np.uint8)


def _pack_q3_k(d: float, scales, q) -> np.ndarray:
    """q: 256 values -4..3 (the weight is d * (scale - 32) * q), 16 6-bit scales; the low 2 bits of q + 4 as Q2_K
    packs per 32-byte group, the 3rd bit (set when q >= 0) in hmask[l] bit 4 * half + k."""
    qs = [0] * 64
    hmask = [0] * 32
    for half in range(2):
        for k in range(4):
            for lane in range(32):
                v = q[128 * half + 32 * k + lane] + 4
                qs[32 * half + lane] |= (v & 3) << (2 * k)
                hmask[lane] |= (v >> 2) << (4 * half + k)
    packed = [0] * 12
    for s in range(16):
        packed[s % 8] |= (scales[s] & 15) << (4 * (s // 8))
        packed[8 + s % 4] |= (scales[s] >> 4) << (2 * (s // 4))
    return np.array(hmask + qs + packed + _f16_bytes(d), dtype=np.uint8)


@pytest.fixture
def rng():
    return np.random.default_rng(35)


def test_q4_k_and_q5_k_from_the_layout(rng):
    d, dmin = 0.0625, 0.5
    scales = [int(s) for s in rng.integers(0, 64, 8)]
    mins = [int(m) for m in rng.integers(0, 64, 8)]
    scales[5], mins[6] = 63, 48  # top 2 bits set on the packed-apart half
    for pack, bits in ((_pack_q4_k, 4), (_pack_q5_k, 5)):
        q = [int(v) for v in rng.integers(0, 1 << bits, QK_K)]
        block = pack(d, dmin, scales, mins, q)
        assert block.size == KQUANT_BLOCK_BYTES[f"Q{bits}_K"]
        sub = np.arange(QK_K) // 32
        want = (np.float32(d) * np.array(scales, np.float32)[sub] * np.array(q, np.float32)
                - np.float32(dmin) * np.array(mins, np.float32)[sub])
        np.testing.assert_array_equal(dequantize_kquant(f"Q{bits}_K", block), want)


def test_q6_k_from_the_layout(rng):
    d = 0.03125
    scales = [int(s) for s in rng.integers(-128, 128, 16)]
    q = [int(v) for v in rng.integers(0, 64, QK_K)]
    block = _pack_q6_k(d, scales, q)
    assert block.size == KQUANT_BLOCK_BYTES["Q6_K"]
    want = np.float32(d) * np.array(scales, np.float32)[np.arange(QK_K) // 16] * (np.array(q, np.float32) - 32)
    np.testing.assert_array_equal(dequantize_kquant("Q6_K", block), want)


def test_q2_k_and_q3_k_from_the_layout(rng):
    d, dmin = 0.25, 0.125
    sub = np.arange(QK_K) // 16
    scales = [int(s) for s in rng.integers(0, 16, 16)]
    mins = [int(m) for m in rng.integers(0, 16, 16)]
    q = [int(v) for v in rng.integers(0, 4, QK_K)]
    want = (np.float32(d) * np.array(scales, np.float32)[sub] * np.array(q, np.float32)
            - np.float32(dmin) * np.array(mins, np.float32)[sub])
    np.testing.assert_array_equal(dequantize_kquant("Q2_K", _pack_q2_k(d, dmin, scales, mins, q)), want)

    scales6 = [int(s) for s in rng.integers(0, 64, 16)]
    q3 = [int(v) for v in rng.integers(-4, 4, QK_K)]
    block = _pack_q3_k(d, scales6, q3)
    assert block.size == KQUANT_BLOCK_BYTES["Q3_K"]
    want3 = np.float32(d) * (np.array(scales6, np.float32)[sub] - 32) * np.array(q3, np.float32)
    np.testing.assert_array_equal(dequantize_kquant("Q3_K", block), want3)


@pytest.mark.parametrize("qtype", sorted(KQUANT_BLOCK_BYTES))
def test_random_blocks_match_the_gguf_package(qtype, rng):
    from gguf import GGMLQuantizationType, quants

    size = KQUANT_BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(3, 37 * size), dtype=np.uint8)  # 3 rows of 37 super-blocks
    # The float16 factors (d, dmin) get finite random values: random bytes would sometimes spell inf or NaN.
    offsets = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[qtype]
    blocks = raw.reshape(-1, size)
    for at in offsets:
        blocks[:, at:at + 2] = rng.uniform(-2.0, 2.0, blocks.shape[0]).astype("<f2").view(np.uint8).reshape(-1, 2)
    ours = dequantize_kquant(qtype, raw)
    oracle = quants.dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float32).reshape(-1)
    assert ours.dtype == np.float32 and ours.shape == (3 * 37 * QK_K,)
    np.testing.assert_array_equal(ours, oracle)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="not one of"):
        dequantize_kquant("Q7_K", np.zeros(144, np.uint8))
    with pytest.raises(ValueError, match="whole number of 144-byte blocks"):
        dequantize_kquant("Q4_K", np.zeros(145, np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_kquant("Q4_K", np.zeros(144, np.float32))
