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
