"""What every CUDA op launcher shares: the host-array test, storage types, strides in elements, contiguous
rows, integer kernel arguments, a dummy pointer, and the KV cache pair's checks."""

from __future__ import annotations

from typing import Any

import numpy as np

from .modules import STORAGE_TYPES


def is_cupy_array(x: Any) -> bool:
    """True for a CuPy ndarray, decided without importing CuPy."""
    return type(x).__module__.startswith("cupy")


def _storage_type(dtype, what: str) -> str:
    t = STORAGE_TYPES.get(np.dtype(dtype))
    if t is None:
        raise ValueError(f"{what}: dtype {np.dtype(dtype)} is not supported on the GPU (float16 or float32)")
    return t


def _elements(stride_bytes: int, itemsize: int, what: str) -> int:
    if stride_bytes % itemsize:
        raise ValueError(f"{what}: stride {stride_bytes} bytes is not a multiple of the item size")
    return stride_bytes // itemsize


def _inner_contiguous(x, what: str):
    """x with its last axis contiguous (a copy only when it is not)."""
    import cupy

    if x.ndim == 0:
        raise ValueError(f"{what}: expected an array with at least one axis")
    if x.strides[-1] != x.itemsize or any(s < 0 for s in x.strides):
        x = cupy.ascontiguousarray(x)
    return x


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _i32(x: int) -> np.int32:
    return np.int32(x)


def _i64(x: int) -> np.int64:
    return np.int64(x)


_dummies: dict[tuple[int, str], Any] = {}


def _dummy(dtype=np.float32):
    """A valid device pointer for kernel arguments that a launch does not use (one per device and dtype)."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), np.dtype(dtype).str)
    d = _dummies.get(key)
    if d is None:
        d = _dummies[key] = cupy.zeros(1, dtype=dtype)
    return d


def _check_cache_pair(k_cache, v_cache, what: str) -> None:
    if not (is_cupy_array(k_cache) and is_cupy_array(v_cache)):
        raise ValueError(f"{what}: k_cache and v_cache must be CuPy arrays")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{what}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         "[num_blocks, block_size, num_kv_heads, head_dim] with one dtype")
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError(f"{what}: KV caches must be C-contiguous")
