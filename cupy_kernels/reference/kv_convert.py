"""KV values to and from their stored form (cupy_kernels/kv_layout.py): the ground truth for rounding that every
kernel set's cache write and attention are tested against.

bfloat16 is the high half of a float32's bits, rounded to nearest, ties to even, by integer arithmetic on those
bits (x86's VCVTNEPS2BF16 and PyTorch's rounding): add 0x7FFF plus the lowest kept bit, drop the low 16 bits. A
NaN stays a (quiet) NaN; infinities and values that round past the largest bfloat16 become infinities, as the
instruction does. float16 is numpy's own conversion (IEEE round to nearest even; past 65504: infinity).

int8 rows (cupy_kernels/kv_layout.py): each token's row of one kv head is scaled by s = max|x| / 127 (0 for a row
of zeros), its values stored as rint(x / s) (round half to even) clipped to [-127, 127], and s's float32 bytes after
them; a value comes back as q * s, off by at most s / 2 = max|x| / 254 of its row's largest. fp8 rows likewise, s =
max|x| / the format's largest finite value (448 for e4m3, 57344 for e5m2), x / s rounded to nearest even by
ml_dtypes' conversion; a value is then off by at most 2^-4 (e4m3) or 2^-3 (e5m2) of itself, or, near zero, half
the format's smallest subnormal times s.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

_BF16 = np.dtype(np.uint16)
_F32 = np.dtype(np.float32)
_I8 = np.dtype(np.int8)
INT8_MAX = 127
_FP8 = {np.dtype(ml_dtypes.float8_e4m3fn): 448.0, np.dtype(ml_dtypes.float8_e5m2): 57344.0}  # largest finite


def fp8_rows(x: np.ndarray, storage: np.dtype) -> np.ndarray:
    """float32 rows [..., D] as fp8 rows [..., D + 4] of `storage`: the scaled values, then the scale's bytes."""
    x = np.asarray(x, dtype=np.float32)
    scale = (np.abs(x).max(axis=-1, keepdims=True) / np.float32(_FP8[storage])).astype(np.float32)
    values = (x / np.where(scale > 0, scale, np.float32(1.0))).astype(storage)
    return np.concatenate([values, np.ascontiguousarray(scale).view(storage)], axis=-1)


def int8_rows(x: np.ndarray) -> np.ndarray:
    """float32 rows [..., D] as int8 rows [..., D + 4]: the scaled values, then the scale's float32 bytes."""
    x = np.asarray(x, dtype=np.float32)
    scale = (np.abs(x).max(axis=-1, keepdims=True) / np.float32(INT8_MAX)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    values = np.clip(np.rint(x / safe), -INT8_MAX, INT8_MAX).astype(np.int8)
    return np.concatenate([values, np.ascontiguousarray(scale).view(np.int8)], axis=-1)


def scaled_rows_to_float32(rows: np.ndarray) -> np.ndarray:
    """int8 or fp8 rows [..., D + 4] (int8_rows, fp8_rows) as float32 [..., D]."""
    scale = np.ascontiguousarray(rows[..., -4:]).view(np.float32)
    return rows[..., :-4].astype(np.float32) * scale


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """x (float32) rounded to nearest even bfloat16, as uint16 bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    bits = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x0040), rounded)
    return bits.astype(np.uint16)


def bf16_bits_to_float32(b: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) as float32: exact (a bfloat16 is a float32 with 16 low zero bits)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode(x: np.ndarray, storage: np.dtype) -> np.ndarray:
    """float32 values in the cache's storage dtype (uint16: bfloat16 bits)."""
    if np.dtype(storage) == _BF16:
        return float32_to_bf16_bits(np.asarray(x, dtype=np.float32))
    if np.dtype(storage) == _I8:
        return int8_rows(x)
    if np.dtype(storage) in _FP8:
        return fp8_rows(x, np.dtype(storage))
    with np.errstate(over="ignore"):  # past float16's largest: infinity, as documented above
        return np.asarray(x).astype(storage, copy=False)


def decode(stored: np.ndarray) -> np.ndarray:
    """Cache rows as float32 (a view when they are float32 already)."""
    if stored.dtype == _BF16:
        return bf16_bits_to_float32(stored)
    if stored.dtype == _I8 or stored.dtype in _FP8:
        return scaled_rows_to_float32(stored)
    return stored.astype(_F32, copy=False)
