"""Allocating the per-layer paged KV cache arrays: [num_blocks, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

from typing import Any

from pagedserve.cupy_kernels.backend import Backend

from .config import ModelConfig
from .tensor_parallel import TPShard


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int,
                   shard: TPShard | None = None) -> tuple[int, int, int, int]:
    """A tensor-parallel rank holds only its KV heads."""
    num_kv_heads = (shard or TPShard()).kv_heads(config)[1]
    return (num_blocks, block_size, num_kv_heads, config.head_dim)


def kv_bytes_per_block(config: ModelConfig, block_size: int, itemsize: int, shard: TPShard | None = None) -> int:
    """Bytes one block takes across all layers, K and V (on one rank, given its `shard`)."""
    num_kv_heads = (shard or TPShard()).kv_heads(config)[1]
    return 2 * config.num_hidden_layers * block_size * num_kv_heads * config.head_dim * itemsize


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, backend: Backend,
                       shard: TPShard | None = None) -> list[tuple[Any, Any]]:
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
    shape = kv_cache_shape(config, num_blocks, block_size, shard)
    xp = backend.xp
    return [(xp.zeros(shape, dtype=backend.dtype), xp.zeros(shape, dtype=backend.dtype))
            for _ in range(config.num_hidden_layers)]
