"""Worker: one tensor-parallel rank. It owns the model (shard), its KV pool, the CUDA graphs and the
block copies, and runs the forward. The engine never touches any of these directly.

    driver process                                   rank process (one per rank > 0)
    LLMEngine: schedule -> execute -> update
      ModelRunner: sequences -> ForwardBatch
      Executor.execute_model(ExecuteModelRequest) --broadcast--> Worker.execute_model
        Worker (rank 0).execute_model                              copy_blocks, forward
          copy_blocks, forward  <------ all-reduce x 2 per layer ------>
          logits (gathered on rank 0) -> sampler (once, on the driver)

Everything a worker does depends only on the config, its rank and what the driver broadcasts, so
ranks stay in step; a single-rank engine runs the very same Worker in-process.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import structlog

from pagedserve.cupy_kernels.backend import finish_warm_up, get_backend
from pagedserve.cupy_kernels.host.blas_threads import set_blas_threads, set_cpu_threads
from pagedserve.cupy_kernels.host.malloc import tune_malloc
from pagedserve.cupy_kernels.kv_layout import check_kv_cache_dtype, kv_cache_layout
from pagedserve.models.batch import ForwardBatch
from pagedserve.models.kv_cache import allocate_kv_caches, kv_bytes_per_block
from pagedserve.models import registry
from pagedserve.models.loading.loader import LoadedModel, load_model
from pagedserve.models.tensor_parallel import TPShard, check_tensor_parallel, shard_weights

from ..config import EngineConfig, check_gpu_block_size
from ..core.kv_cache_manager import KVCacheGroups, kv_cache_groups
from .cuda_graphs import DecodeGraphs, build_decode_graphs
from .gpu_memory import profile_kv_cache
from .memory_budget import default_cpu_kv_bytes, host_memory_available

log = structlog.get_logger("pagedserve.engine")


@dataclass
class ExecuteModelRequest:
    """What the driver broadcasts to every rank for one step (plain numpy, cheap to pickle)."""

    batch: ForwardBatch
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the forward
    # LoRA: (slot, adapter) copies into the model's slots (models/lora.py), before the forward (runtime/lora/)
    lora_updates: list = field(default_factory=list)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1, comm: Any = None,
                 loaded: LoadedModel | None = None, local_device: int | None = None) -> None:
        """`local_device`: the GPU index this rank uses (default: its rank; Ray actors see only theirs, 0)."""
        if world_size > 1 and config.enable_cuda_graphs:
            # Collectives inside captured graphs are not supported here: tensor-parallel ranks run eagerly
            # (and the GPU KV sizing then reserves no graph memory).
            config = dataclasses.replace(config, enable_cuda_graphs=False)
        self.config = config
        self.rank, self.world_size = rank, world_size
        if isinstance(config.cpu_threads, int):
            set_cpu_threads(config.cpu_threads)  # BLAS threads, and numba's when that kernel set runs
        # "auto": the engine's CpuThreadsTuner sets them step by step, starting from the count at start.
        elif world_size > 1 and not os.environ.get("OPENBLAS_NUM_THREADS"):
            # N ranks on one host: split the cores rather than let every rank's OpenBLAS take them all.
            set_blas_threads(max(1, (os.cpu_count() or 1) // world_size))
        # The numba set's attention kernels may still be compiling in a child process (an empty cache): the
        # model loads and packs its weights meanwhile, and finish_warm_up waits for them below.
        self.backend = get_backend(config.device, config.cpu_kernels, finish_warm_up=False)
        # The pool's layout, refused before the model loads when the kernel set cannot run it.
        self.kv_layout = kv_cache_layout(config.kv_cache_dtype, self.backend.dtype)
        check_kv_cache_dtype(self.kv_layout, self.backend.ops.name, self.backend.ops.kv_cache_dtypes, None)
        # CPU: keep freed activation pages mapped between steps (cupy_kernels/host/malloc.py).
        self.malloc = {} if self.backend.is_gpu else tune_malloc()
        if self.backend.is_gpu:  # device "auto" resolved to the GPU
            check_gpu_block_size(config.block_size)
            if world_size > 1:
                # One GPU per rank (the executor checked the count).
                self.backend.xp.cuda.Device(rank if local_device is None else local_device).use()
        self.shard = shard = TPShard(rank, world_size)
        loaded = loaded or load_model(config.model, use_cache=config.use_weight_cache, shard=shard)
        weights = loaded.weights
        if loaded.shard != shard:  # whole weights handed in from memory: take this rank's slices
            if loaded.shard.is_sharded:
                raise ValueError(f"weights loaded for rank {loaded.shard.rank} of {loaded.shard.world_size} "
                                 f"cannot serve rank {rank} of {world_size}")
            check_tensor_parallel(loaded.config, world_size)
            weights = shard_weights(loaded.config, weights, shard)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name, self.model_path = loaded.name, loaded.path
        model_class = registry.for_config(loaded.config).model_class
        self.model = model_class(loaded.config, weights, self.backend, source=str(loaded.path), shard=shard,
                                 comm=comm)
        if config.enable_lora:  # the adapters' execution slots (models/lora.py), empty until the engine fills them
            from pagedserve.models import lora as model_lora

            model_lora.attach(self.model, weights, config.max_loras, config.max_lora_rank)
        check_kv_cache_dtype(self.kv_layout, self.backend.ops.name, self.backend.ops.kv_cache_dtypes,
                             self.model_config.head_dim)
        finish_warm_up(self.backend, self.kv_layout.dtype)
        self.kv_groups = model_kv_groups(self.model, self.model_config.num_hidden_layers)
        self.kv_caches: list[tuple[Any, Any]] | None = None  # per layer (layers of a KV group layout share pairs)
        self.kv_pairs: list[tuple[Any, Any]] | None = None  # the distinct pairs (block copies go through these)
        self.graphs: DecodeGraphs | None = None
        self.kv_sizing = None  # GPU: the gpu_memory.KVCacheSizing behind the pool's size

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block on this rank (its KV heads only), all layers, K and V."""
        return kv_bytes_per_block(self.model_config, self.config.block_size, self.kv_layout, self.shard,
                                  self.kv_groups.num_tensors)

    def determine_num_kv_blocks(self, max_model_len: int) -> int:
        """How many KV blocks this rank can hold. CPU: kv_cache_memory_bytes (unset: 4 GiB or half of what the
        host has available, memory_budget.default_cpu_kv_bytes) is the whole engine's budget, split evenly
        across ranks. GPU: a profile forward measures what is left (gpu_memory.py)."""
        per_block = self.kv_bytes_per_block()
        if self.backend.is_gpu:
            sizing = profile_kv_cache(self.model, self.config, max_model_len, self.config.block_size, per_block)
            log.info("engine.kv_sizing", model=self.model_name, rank=self.rank, **sizing.log_fields())
            self.kv_sizing = sizing
            return sizing.num_blocks
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            available, source = host_memory_available()
            budget = default_cpu_kv_bytes(available)
            log.info("engine.kv_cache_default", rank=self.rank, kv_cache_gib=round(budget / 2**30, 3),
                     available_gib=round(available / 2**30, 3) if available else None, available_from=source)
        budget //= self.world_size
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget of {budget} bytes (per rank) holds no block of {per_block} bytes")
        return int(num_blocks)

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate the KV pool; on a single GPU, capture the decode graphs against it (None: eager)."""
        self.kv_pairs = allocate_kv_caches(self.model_config, num_blocks, self.config.block_size, self.backend,
                                           self.shard, self.kv_groups.num_tensors, self.kv_layout.storage)
        self.kv_caches = [self.kv_pairs[t] for t in self.kv_groups.layer_tensor]
        # The decode graphs' static batch holds one block table: a model reading several KV groups runs eager.
        grouped = len(self.kv_groups.windows) > 1
        if grouped:
            log.info("engine.kv_groups", rank=self.rank, windows=list(self.kv_groups.windows),
                     array_pairs=self.kv_groups.num_tensors)
        self.graphs = build_decode_graphs(self.config, self.model, self.kv_caches, max_model_len,
                                          layer_group=self.kv_groups.layer_group if grouped else ())

    def execute_model(self, request: ExecuteModelRequest) -> Any:
        """Block copies, then one forward; float32 logits of the batch's logits rows on rank 0, None elsewhere."""
        self.backend.ops.copy_blocks(self.kv_pairs, request.block_copies)  # once per array pair
        for slot, adapter in request.lora_updates:
            self.model.lora.set(slot, adapter)
        # (the slots are written in place before the step: a decode graph's LoRA kernels read them at replay)
        logits = self.graphs.run(request.batch) if self.graphs is not None else None
        if logits is None:  # no graph for this step (CPU, graphs off, prefill in the batch, too many rows)
            logits = self.model.forward(request.batch, self.kv_caches)
        return logits


def model_kv_groups(model: Any, num_layers: int) -> KVCacheGroups:
    """The KV cache layout for `model`: groups by its layers' sliding windows (`model.windows`) when it reads
    each layer's group from the batch (`reads_kv_cache_groups`, ForwardBatch.kv_tables); else one group of
    every layer, each in its own K/V pair (a window then still holds in the kernels, but no block is
    released)."""
    windows = getattr(model, "windows", None)
    if windows and getattr(model, "reads_kv_cache_groups", False):
        return kv_cache_groups(windows)
    return kv_cache_groups([None] * num_layers)
