"""KV values to and from their stored form (cupy_kernels/kv_layout.py): the ground truth for rounding that every
kernel set's cache write and attention are tested against.

bfloat16 is the high half of a float32's bits, rounded to nearest, ties to even, by integer arithmetic on those
bits (x86's VCVTNEPS2BF16 and PyTorch's rounding): add 0x7FFF plus the lowest kept bit, drop the low 16 bits. A
NaN stays a (quiet) NaN; infinities and values that round past the largest bfloat16 become infinities, as the
instruction does. float16 is numpy's own conversion (IEEE round to nearest even; past 65504: infinity).
"""

from __future__ import annotations

import numpy as np

_BF16 = np.dtype(np.uint16)
_F32 = np.dtype(np.float32)


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
    with np.errstate(over="ignore"):  # past float16's largest: infinity, as documented above
        return np.asarray(x).astype(storage, copy=False)


def decode(stored: np.ndarray) -> np.ndarray:
    """Cache rows as float32 (a view when they are float32 already)."""
    if stored.dtype == _BF16:
        return bf16_bits_to_float32(stored)
    return stored.astype(_F32, copy=False)
