"""Allocating the per-layer paged KV cache arrays: [num_blocks, block_size, num_kv_heads, head_dim], each value in
the pool's kv_cache_dtype (its layout: cupy_kernels/kv_layout.py; "auto" = the backend's dtype)."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from pagedserve.cupy_kernels.backend import Backend
from pagedserve.cupy_kernels.kv_layout import KVCacheLayout, row_elements

from .config import ModelConfig
from .tensor_parallel import TPShard


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int,
                   shard: TPShard | None = None, storage: Any = None) -> tuple[int, int, int, int]:
    """A tensor-parallel rank holds only its KV heads; an int8 row holds its scale too (kv_layout.row_elements)."""
    num_kv_heads = (shard or TPShard()).kv_heads(config)[1]
    row = config.head_dim if storage is None else row_elements(storage, config.head_dim)
    return (num_blocks, block_size, num_kv_heads, row)


def kv_bytes_per_block(config: ModelConfig, block_size: int, itemsize: int | KVCacheLayout,
                       shard: TPShard | None = None, num_arrays: int | None = None) -> int:
    """Bytes one block takes across all layers, K and V (on one rank, given its `shard`); `itemsize`: a value's
    bytes, or the pool's KVCacheLayout (its scales counted); `num_arrays`: the K/V array pairs when layers share
    them (KV cache groups: runtime/core/kv_cache_manager.kv_cache_groups)."""
    num_kv_heads = (shard or TPShard()).kv_heads(config)[1]
    layers = config.num_hidden_layers if num_arrays is None else num_arrays
    row = (itemsize.bytes_per_token_head(config.head_dim) if isinstance(itemsize, KVCacheLayout)
           else config.head_dim * itemsize)
    return 2 * layers * block_size * num_kv_heads * row


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, backend: Backend,
                       shard: TPShard | None = None, num_arrays: int | None = None,
                       storage: Any = None) -> list[tuple[Any, Any]]:
    """A K/V array pair per layer, or `num_arrays` pairs when layers share them (KV cache groups). `storage`: the
    arrays' dtype (KVCacheLayout.storage; None: the backend's dtype)."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
    shape = kv_cache_shape(config, num_blocks, block_size, shard, storage)
    zeros = backend.xp.zeros if backend.xp is not np else host_zeros
    dtype = backend.dtype if storage is None else storage
    return [(zeros(shape, dtype=dtype), zeros(shape, dtype=dtype))
            for _ in range(config.num_hidden_layers if num_arrays is None else num_arrays)]


def host_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed host array in anonymous memory of its own, for the CPU KV pool: its pages come from the
    kernel, already zero, on first touch (a block's first write), and none is held before.

    Not np.zeros: numpy advises transparent huge pages for arrays over 4 MB, and on the test VM (THP on
    madvise) a first touch then cost 2.3 s per GiB against 0.34 s in plain pages. A fresh server writing a
    4,000-token prompt's K/V paid ~25 ms per 256-token step for it (bench/jitter.py), 6 ms in plain pages."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # not POSIX
        return np.zeros(shape, dtype=dtype)
    nbytes = count * dtype.itemsize
    try:
        buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:  # e.g. ENOMEM under strict overcommit: say what was asked for, as numpy would
        raise MemoryError(f"cannot map {nbytes / (1 << 30):.2f} GiB for a KV cache array of shape {tuple(shape)}: "
                          f"{e.strerror or e}; lower kv_cache_memory_bytes") from e
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)
