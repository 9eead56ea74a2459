"""Megatron-style tensor parallelism for the Llama block: which slice of each weight a rank holds.

    rank r of N            q/k/v, gate/up (column-parallel)     o_proj, down (row-parallel)
    attention heads        [r*H/N, (r+1)*H/N)                    the same heads' input columns
    KV heads (N <= KV)     [r*KV/N, (r+1)*KV/N)
    KV heads (N > KV)      the one head r*KV//N (replicated N/KV times; GQA groups stay whole)
    MLP                    [r*ceil(I/N), ...) of gate and of up  the same input columns of down
    vocabulary             [r*ceil(V/N), ...) rows of embed_tokens and lm_head

Column-parallel layers need no communication (each rank computes its heads); a row-parallel layer
yields a partial sum that one all-reduce completes, so a layer costs two all-reduces. The embedding
lookup is vocab-parallel (each rank fills the rows of its ids, zero elsewhere, one all-reduce sums them),
and the logits are gathered on rank 0. Norm weights are replicated.

`index_for` names the slice of one checkpoint tensor; the loaders apply it to memory-mapped files, so a
rank reads only its shard from disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .config import ModelConfig

_Index = tuple[slice, ...] | None


@dataclass(frozen=True)
class TPShard:
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.world_size}")

    @property
    def is_sharded(self) -> bool:
        return self.world_size > 1

    # -- sizes ------------------------------------------------------------------------------

    def heads(self, config: ModelConfig) -> tuple[int, int]:
        """(first attention head, count) of this rank."""
        n = config.num_attention_heads // self.world_size
        return self.rank * n, n

    def kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        """(first KV head, count): split when N <= KV, else one head shared by N/KV ranks."""
        kv, n = config.num_key_value_heads, self.world_size
        if n <= kv:
            return self.rank * (kv // n), kv // n
        return self.rank * kv // n, 1

    def intermediate(self, config: ModelConfig) -> tuple[int, int]:
        """(first MLP column, count): ceil(I / N) each, the last rank the rest (the all-reduce does not mind)."""
        per = -(-config.intermediate_size // self.world_size)
        start = min(self.rank * per, config.intermediate_size)
        return start, min(per, config.intermediate_size - start)

    def vocab_per_rank(self, config: ModelConfig) -> int:
        return -(-config.vocab_size // self.world_size)

    def vocab(self, config: ModelConfig) -> tuple[int, int]:
        """[start, end) of this rank's vocabulary rows (the last ranks may hold fewer, even none)."""
        per = self.vocab_per_rank(config)
        return min(self.rank * per, config.vocab_size), min((self.rank + 1) * per, config.vocab_size)

    # -- slices of checkpoint tensors (Hugging Face names, [out, in] matrices) ----------------

    def index_for(self, config: ModelConfig, name: str) -> _Index:
        """The slice of tensor `name` this rank holds; None = all of it (replicated)."""
        if not self.is_sharded:
            return None
        hd = config.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, end = self.vocab(config)
            return (slice(start, end),)
        leaf = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        h0, hn = self.heads(config)
        k0, kn = self.kv_heads(config)
        i0, i_n = self.intermediate(config)
        if leaf.startswith("self_attn.q_proj."):
            return (slice(h0 * hd, (h0 + hn) * hd),)
        if leaf.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
            return (slice(k0 * hd, (k0 + kn) * hd),)
        if leaf == "self_attn.o_proj.weight":
            return (slice(None), slice(h0 * hd, (h0 + hn) * hd))
        if leaf in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            return (slice(i0, i0 + i_n),)
        if leaf == "mlp.down_proj.weight":
            return (slice(None), slice(i0, i0 + i_n))
        return None

    def shard_shape(self, config: ModelConfig, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        index = self.index_for(config, name)
        if index is None:
            return tuple(shape)
        return tuple(len(range(*s.indices(d))) for s, d in zip(index + (slice(None),) * len(shape), shape))


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """Raise ValueError naming the numbers when `world_size` cannot split this model evenly."""
    if world_size == 1:
        return
    h, kv, i = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if h % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} must divide the model's {h} attention heads")
    if kv % world_size and world_size % kv:
        raise ValueError(f"tensor_parallel_size {world_size} must divide the model's {kv} KV heads, or be a "
                         f"multiple of them (to replicate each KV head)")
    if i < world_size:
        raise ValueError(f"tensor_parallel_size {world_size} exceeds the model's intermediate size {i}")


def shard_weights(config: ModelConfig, weights: Mapping[str, np.ndarray], shard: TPShard) -> dict[str, np.ndarray]:
    """This rank's slices of full in-memory weights (views where numpy allows)."""
    out = {}
    for name, w in weights.items():
        index = shard.index_for(config, name)
        out[name] = w if index is None else w[index]
    return out
