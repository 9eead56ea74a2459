"""Allocating the per-layer paged KV cache arrays: [num_blocks, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

from typing import Any

from pagedserve.cupy_kernels.backend import Backend

from .config import ModelConfig


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    return (num_blocks, block_size, config.num_key_value_heads, config.head_dim)


def kv_bytes_per_block(config: ModelConfig, block_size: int, itemsize: int) -> int:
    """Bytes one block takes across all layers, K and V."""
    return 2 * config.num_hidden_layers * block_size * config.kv_size * itemsize


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, backend: Backend) -> list[tuple[Any, Any]]:
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
    shape = kv_cache_shape(config, num_blocks, block_size)
    xp = backend.xp
    return [(xp.zeros(shape, dtype=backend.dtype), xp.zeros(shape, dtype=backend.dtype))
            for _ in range(config.num_hidden_layers)]
