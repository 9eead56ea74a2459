"""GGUF block-quantized matmul weights, kept as the file stores them: the container and its numpy reference.

A GGUF file stores most matmul weights in blocks of 32 values along a row (the input dimension) with one
float16 scale per block (and for Q4_1 a float16 minimum):

    Q8_0   w = d * q          q int8                              34 bytes per 32 weights
    Q4_0   w = d * (q - 8)    q 4-bit (low nibbles: 0-15, high: 16-31)  18 bytes
    Q4_1   w = d * q + m      q 4-bit, as Q4_0                    20 bytes

pagedserve dequantizes them to float32 at load (the weights every backend uses). The dequantized value
of a weight is exact in float32 (a 4- or 8-bit integer times an 11-bit float16 mantissa, plus m), so a
kernel that reads the blocks instead computes the same products; only the order of its sums differs.
That kernel is numba_quant.py's (CPU, a few rows at a time): a decode step with few sequences streams
the weights from memory once per step, and 0.6 byte per weight instead of 4 is what makes it faster.

Here the blocks are split into separate arrays a vector loop reads directly: `qs` the quants row by row
(Q8_0: int8, one per weight; Q4_0/Q4_1: uint8, two per byte, in GGUF's nibble order), `scales` and
`mins` float32 [out, in / 32] (Q4_0 becomes Q4_1 with m = -8 d, which is exact). `dequantize` is the
reference every kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # weights per block, for every type here
# bytes per block in the file, by type name (the gguf package's GGMLQuantizationType names)
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
QUANT_TYPES = tuple(BLOCK_BYTES)


@dataclass(frozen=True)
class QuantWeight:
    """One matmul weight [out, in] in blocks. kind "q8" (Q8_0: qs int8 [out, in], no mins) or "q4"
    (Q4_0/Q4_1: qs uint8 [out, in / 2], mins). All arrays C-contiguous and read-only."""

    kind: str
    qs: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None

    @property
    def shape(self) -> tuple[int, int]:
        out, blocks = self.scales.shape
        return out, blocks * BLOCK


def _read_only(a: np.ndarray, dtype) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=dtype)
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def make_quant_weight(kind: str, qs: np.ndarray, scales: np.ndarray, mins: np.ndarray | None) -> QuantWeight:
    """A QuantWeight from its arrays, checked; ValueError on a shape or kind that does not fit."""
    if kind not in ("q8", "q4"):
        raise ValueError(f"quant kind must be 'q8' or 'q4', got {kind!r}")
    scales = _read_only(scales, np.float32)
    if scales.ndim != 2:
        raise ValueError(f"quant scales must be [out, blocks], got shape {scales.shape}")
    out, blocks = scales.shape
    per_row = blocks * BLOCK if kind == "q8" else blocks * BLOCK // 2
    qs = _read_only(qs, np.int8 if kind == "q8" else np.uint8)
    if qs.shape != (out, per_row):
        raise ValueError(f"{kind} quants of shape {qs.shape} do not fit scales {scales.shape} "
                         f"(expected {(out, per_row)})")
    if kind == "q4":
        if mins is None or tuple(mins.shape) != scales.shape:
            raise ValueError(f"q4 weights need mins of shape {scales.shape}")
        mins = _read_only(mins, np.float32)
    else:
        mins = None
    return QuantWeight(kind, qs, scales, mins)


def split_blocks(qtype: str, raw: np.ndarray) -> dict[str, np.ndarray]:
    """GGUF blocks [rows, blocks * block bytes] (uint8, as the file stores a 2-D tensor) -> the arrays of a
    QuantWeight: {"qs", "scales"} for Q8_0, {"qs", "scales", "mins"} for Q4_0 and Q4_1."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"quant type {qtype!r} is not one of {QUANT_TYPES}")
    size = BLOCK_BYTES[qtype]
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"{qtype} blocks must be [rows, k * {size}] bytes, got shape {raw.shape}")
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, size)
    d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
    if qtype == "Q8_0":
        return {"qs": np.ascontiguousarray(b[:, :, 2:]).view(np.int8).reshape(rows, -1), "scales": d}
    if qtype == "Q4_0":
        return {"qs": np.ascontiguousarray(b[:, :, 2:]).reshape(rows, -1), "scales": d, "mins": d * np.float32(-8.0)}
    m = np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
    return {"qs": np.ascontiguousarray(b[:, :, 4:]).reshape(rows, -1), "scales": d, "mins": m}


def kind_of(qtype: str) -> str:
    return "q8" if qtype == "Q8_0" else "q4"


def dequantize(w: QuantWeight) -> np.ndarray:
    """The float32 weight [out, in] the blocks stand for (bit-identical to the gguf package's dequantize)."""
    out, blocks = w.scales.shape
    if w.kind == "q8":
        q = w.qs.reshape(out, blocks, BLOCK).astype(np.float32)
        return (q * w.scales[:, :, None]).reshape(out, -1)
    packed = w.qs.reshape(out, blocks, BLOCK // 2)
    q = np.concatenate([packed & 15, packed >> 4], axis=2).astype(np.float32)
    return (w.scales[:, :, None] * q + w.mins[:, :, None]).reshape(out, -1)


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """One weight of the rows of `parts` in order (fused q/k/v, gate/up); ValueError when they differ in kind
    or input size."""
    kinds = {p.kind for p in parts}
    widths = {p.shape[1] for p in parts}
    if len(kinds) != 1 or len(widths) != 1:
        raise ValueError(f"cannot fuse quantized weights of kinds {sorted(kinds)} and widths {sorted(widths)}")
    kind = parts[0].kind
    mins = np.concatenate([p.mins for p in parts]) if kind == "q4" else None
    return make_quant_weight(kind, np.concatenate([p.qs for p in parts]),
                             np.concatenate([p.scales for p in parts]), mins)


def linear(x: np.ndarray, w: QuantWeight) -> np.ndarray:
    """The reference: x [T, in] @ dequantize(w).T -> [T, out], float32."""
    return np.asarray(x, dtype=np.float32) @ dequantize(w).T


# -- k-quants: super-blocks of 256 weights ------------------------------------------------------------------
#
# llama.cpp's k-quants pack 256 weights (a super-block) with one or two float16 factors and small per-
# sub-block scales. Byte layouts (ggml-common.h's block_q*_K), in file order:
#
#   Q2_K  84 B  scales[16] (low nibble scale, high nibble min, per 16 weights), qs[64] (2 bits), d, dmin
#               w = d * (scale) * q - dmin * (min)
#   Q3_K 110 B  hmask[32] (the 3rd bit), qs[64] (low 2 bits), scales[12] (16 6-bit scales, packed), d
#               w = d * (scale - 32) * (q - (4 if the hmask bit is clear else 0))
#   Q4_K 144 B  d, dmin, scales[12] (8 6-bit scales + 8 6-bit mins, per 32 weights), qs[128] (4 bits)
#               w = d * scale * q - dmin * min
#   Q5_K 176 B  d, dmin, scales[12] (as Q4_K), qh[32] (the 5th bit), qs[128] (low 4 bits)
#               w = d * scale * q - dmin * min,  q = low | high << 4
#   Q6_K 210 B  ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8, per 16 weights), d
#               w = d * scale * (q - 32)
#
# Within a super-block the quants run in chunks: Q4_K/Q5_K's qs[32 j : 32 j + 32] holds weights 64 j ..
# 64 j + 31 in its low nibbles and 64 j + 32 .. 64 j + 63 in its high ones, the same byte feeding two sub-blocks
# (Q5_K's qh[l] bit 2 j and 2 j + 1 are those two weights' 5th bits). Q6_K and Q2_K/Q3_K work per half of 128:
# byte l of a 32-byte group serves the weights l, l + 32, l + 64, l + 96 of the half, at shifts 0, 2, 4, 6 (or
# nibbles). The products keep llama.cpp's order (d * scale first, then times q, minus dmin * min), so the result
# is bit-identical to its dequantize_row_q*_K and to the gguf package's.
#
# pagedserve dequantizes k-quants to float32 at load; it keeps no k-quant blocks for the decode kernels (the
# Q8_0/Q4 paths above are the only weights read as blocks).

QK_K = 256
KQUANT_BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
KQUANT_TYPES = tuple(KQUANT_BLOCK_BYTES)


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n, 1] float32 from a little-endian float16."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 scales and 8 mins (6 bits each), as float32 [n, 8].

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales/mins 4-7 take their low 4 bits from
    the nibbles of bytes 8-11 and their top 2 bits from the top 2 bits of bytes 0-3 / 4-7.
    """
    lo, hi, mix = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([lo & 63, (mix & 15) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _nibbles_by_chunk(qs: np.ndarray) -> np.ndarray:
    """[n, 128] packed bytes -> [n, 8, 32] 4-bit values: chunk j's low nibbles, then its high nibbles."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(-1, 8, 32)


def _dequant_q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    scales, mins = _scale_min_k4(b[:, 4:16])
    q = _nibbles_by_chunk(b[:, 16:144]).astype(np.float32)
    return ((d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]).reshape(-1, QK_K)


def _dequant_q5_k(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    scales, mins = _scale_min_k4(b[:, 4:16])
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # bit s: sub-block s
    q = (_nibbles_by_chunk(b[:, 48:176]) | (high << 4)).astype(np.float32)
    return ((d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]).reshape(-1, QK_K)


def _dequant_q6_k(b: np.ndarray) -> np.ndarray:
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)  # [n, half, byte group, 32]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)  # per 16 weights
    d = _f16(b[:, 208:210])
    low = (ql.reshape(-1, 2, 1, 2, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1, 1)) & 15
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3  # [n, half, 4, 32]
    q = low.reshape(-1, 2, 4, 32).astype(np.int16) | (high.astype(np.int16) << 4)  # weight 32 k + l of a half
    q = (q - 32).astype(np.float32).reshape(-1, 16, 16)
    return ((d * scales)[:, :, None] * q).reshape(-1, QK_K)


def _dequant_q2_k(b: np.ndarray) -> np.ndarray:
    packed = b[:, 0:16]
    scales, mins = (packed & 15).astype(np.float32), (packed >> 4).astype(np.float32)
    qs = b[:, 16:80].reshape(-1, 2, 1, 2, 16)  # [n, half, shift, 16-byte group, 16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = ((qs >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1, 1)) & 3).astype(np.float32)
    q = q.reshape(-1, 16, 16)  # sub-block s = 16 weights with one scale, in weight order
    return ((d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]).reshape(-1, QK_K)


def _dequant_q3_k(b: np.ndarray) -> np.ndarray:
    hmask = b[:, 0:32].reshape(-1, 1, 1, 32)
    qs = b[:, 32:96].reshape(-1, 2, 1, 32)  # [n, half, shift, 32]
    packed = b[:, 96:108]
    d = _f16(b[:, 108:110])
    # 16 6-bit scales: low 4 bits from the nibbles of bytes 0-7 (scales 0-7 low nibbles, 8-15 high nibbles),
    # top 2 bits from bytes 8-11 (byte 8 + k holds scales k, k + 4, k + 8, k + 12 at shifts 0, 2, 4, 6).
    low = np.concatenate([packed[:, 0:8] & 15, packed[:, 0:8] >> 4], axis=1)
    top = (packed[:, 8:12].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)) & 3
    scales = (low | (top.reshape(-1, 16) << 4)).astype(np.float32) - 32
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ((qs >> shifts) & 3).astype(np.int8)  # [n, half, shift, 32]: weight 32 * shift + l of the half
    bit = (hmask >> np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1)) & 1  # hmask bit 4 * half + shift
    q = (q - np.where(bit == 1, 0, 4).astype(np.int8)).astype(np.float32).reshape(-1, 16, 16)
    return ((d * scales)[:, :, None] * q).reshape(-1, QK_K)


_KQUANT_DEQUANT = {"Q2_K": _dequant_q2_k, "Q3_K": _dequant_q3_k, "Q4_K": _dequant_q4_k, "Q5_K": _dequant_q5_k,
                   "Q6_K": _dequant_q6_k}


def dequantize_kquant(qtype: str, raw: np.ndarray) -> np.ndarray:
    """The float32 weights of k-quant super-blocks: `raw` holds whole blocks (uint8, any shape whose size is a
    multiple of the block bytes, as the file stores a tensor); returns a flat array of 256 weights per block."""
    if qtype not in KQUANT_BLOCK_BYTES:
        raise ValueError(f"quant type {qtype!r} is not one of {KQUANT_TYPES}")
    size = KQUANT_BLOCK_BYTES[qtype]
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"{qtype} blocks must be uint8 bytes, got {raw.dtype}")
    if raw.size % size:
        raise ValueError(f"{qtype} data of {raw.size} bytes is not a whole number of {size}-byte blocks")
    blocks = raw.reshape(-1, size)
    out = np.empty((blocks.shape[0], QK_K), dtype=np.float32)
    step = 1 << 14  # blocks per slice: bounds the temporaries (about 16 MB of float32 per array)
    for start in range(0, blocks.shape[0], step):
        out[start:start + step] = _KQUANT_DEQUANT[qtype](blocks[start:start + step])
    return out.reshape(-1)


# -- 8-bit activations and integer dot products (numba_cpu/quant_int8.py) ------------------------------------
#
# llama.cpp multiplies a Q4_0/Q4_1/Q8_0 weight by activations quantized per block of 32 to 8 bits (its block_q8_1,
# or block_q8_0 for Q8_0 weights; ggml-quants.c quantize_row_q8_1_ref), with integer dot products per block:
#
#   activations  da = amax|x_b| / 127,  a_i = roundf(x_i / da) (half away from zero; 0 when da = 0),
#                sa = da * sum_i a_i   (Q8_1's s: the block's sum, for the weight's minimum)
#   Q4_1 x Q8_1  y += (dw da) * sum_i q_i a_i + m sa     (ggml_vec_dot_q4_1_q8_1)
#   Q4_0 x Q8_0  y += (dw da) * sum_i (q_i - 8) a_i      (here as Q4_1 with m = -8 dw: the same in exact arithmetic)
#   Q8_0 x Q8_0  y += (dw da) * sum_i q_i a_i
#
# Differences from llama.cpp, on purpose: da and sa stay float32 (llama.cpp rounds them to float16), and Q4_0
# takes the Q4_1 form. The integer sums sum_i q_i a_i are exact and the same in every kernel; the float32 result
# then differs from the float32-activation reference by the rounding of x to da a: at most da / 2 per value, so
# |y_q8 - y_f32| <= sum_b (da_b / 2) sum_{i in b} |w_i| (act_quant_bound), plus float32 rounding.

ACT_QMAX = 127


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, in] float32 (in a multiple of 32) -> (a int8 [T, in], da float32 [T, in / 32], sa float32 [T, in / 32])
    as above; every operation in float32, as the numba kernel does it (the two agree bit for bit)."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"activations must be [T, k * {BLOCK}], got shape {x.shape}")
    rows, k = x.shape
    xb = x.reshape(rows, k // BLOCK, BLOCK)
    amax = np.abs(xb).max(axis=2, initial=np.float32(0.0))
    da = (amax / np.float32(ACT_QMAX)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(da != 0, np.float32(1.0) / da, np.float32(0.0)).astype(np.float32)
    v = xb * inv[:, :, None]
    t = np.trunc(v)
    q = t + np.where(np.abs(v - t) >= np.float32(0.5), np.sign(v), np.float32(0.0))  # roundf: half away from 0
    a = np.clip(q, -ACT_QMAX, ACT_QMAX).astype(np.int8)
    sa = (a.astype(np.int32).sum(axis=2).astype(np.float32) * da).astype(np.float32)
    return a.reshape(rows, k), da, sa


def weight_quants(w: QuantWeight) -> np.ndarray:
    """The integer quants of w [out, in] in weight order (Q4: 0-15, the minimum kept apart in mins; Q8: -127-127)."""
    out, blocks = w.scales.shape
    if w.kind == "q8":
        return w.qs.astype(np.int32)
    packed = w.qs.reshape(out, blocks, BLOCK // 2)
    return np.concatenate([packed & 15, packed >> 4], axis=2).reshape(out, -1).astype(np.int32)


def block_int_sums(a: np.ndarray, w: QuantWeight) -> np.ndarray:
    """sum_i q_i a_i per block: int32 [T, out, blocks] (exact; what the kernel's integer dot products add)."""
    out, blocks = w.scales.shape
    q = weight_quants(w).reshape(out, blocks, BLOCK)
    return np.einsum("tbi,obi->tob", a.reshape(a.shape[0], blocks, BLOCK).astype(np.int64), q.astype(np.int64)
                     ).astype(np.int32)


def linear_q8(x: np.ndarray, w: QuantWeight) -> np.ndarray:
    """The reference of the 8-bit-activation matmul: x quantized (quantize_activations), then
    y[t, n] = sum_b (dw[n, b] da[t, b]) isum[t, n, b] + m[n, b] sa[t, b], summed in float64 -> float32."""
    a, da, sa = quantize_activations(x)
    isum = block_int_sums(a, w).astype(np.float64)
    scale = w.scales.astype(np.float32)[None, :, :] * da[:, None, :]  # float32 products, as the kernel rounds them
    y = (scale.astype(np.float64) * isum).sum(axis=2)
    if w.mins is not None:
        y += sa.astype(np.float64) @ w.mins.astype(np.float64).T
    return y.astype(np.float32)


def act_quant_bound(x: np.ndarray, w: QuantWeight) -> np.ndarray:
    """[T, out]: sum_b (da_b / 2) sum_{i in b} |w_i|, the most rounding x to 8 bits can move an output."""
    _, da, _ = quantize_activations(x)
    out, blocks = w.scales.shape
    l1 = np.abs(dequantize(w)).reshape(out, blocks, BLOCK).sum(axis=2, dtype=np.float64)
    return (da.astype(np.float64) / 2) @ l1.T
