"""How many KV blocks fit on the GPU: a profile forward, then plain arithmetic.

    budget = gpu_memory_utilization x total device memory
    kv     = budget - (weights + other live arrays + pool cache + memory outside the pool)   <- in use now
                    - activation peak                                                      <- profiled
                    - CUDA graph memory                                                    <- profiled
    blocks = kv // bytes per block (K and V, all layers)

The profile (after the weights are on the device, before the KV cache exists) runs the forward
passes whose activations are largest and lets the sampler work on their logits:
  1. a mixed prefill batch of max_num_batched_tokens tokens over as many sequences as may run
     (their logits go through the sampler with top_p, logprobs and a penalty: its [B, V] temporaries);
  2. a decode batch of max(min(max_num_seqs, max_num_batched_tokens)) sequences with block tables as
     wide as max_model_len needs: the attention kernel sizes its split-decode workspace
     [B, heads, partitions, head_dim] float32 from that width.
The activation peak is how much CuPy's default memory pool grew over them (it keeps what it
allocates, so its total after the runs is its high-water mark, fragmentation included). With CUDA
graphs on, a decode forward at the largest captured size and widest table runs under a throw-away
pool; cuda_graphs.graph_pool_reserve of its size plus the graphs' shared static buffers is counted.
(The arena the graphs' private pool draws from is reserved at capture by the same rule, from the
warm-ups of every graph; smaller graphs reuse the largest one's blocks, which the margin covers.)
The attention's float32 partials are capped per launch (cuda_ops.PARTITION_SCRATCH_BYTES), so a
long max_model_len no longer costs [max_num_seqs, heads, partitions, head_dim] here.

Everything else in use is read from cudaMemGetInfo and the pool's counters after the profile's
temporaries are returned to the driver, so memory held by the CUDA context, cuBLAS, loaded kernels
or another process on the same GPU shrinks the KV cache instead of making it fail to allocate.

`size_kv_cache` is the pure arithmetic (unit-tested with made-up numbers on the CPU);
`profile_kv_cache` does the CuPy calls.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from pagedserve.models import registry
from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.device_batch import unpack_batch
from pagedserve.models.kv_cache import allocate_kv_caches

from ..config import EngineConfig
from .cuda_graphs import graph_pool_reserve, pack_decode_batch, resolve_batch_sizes

GIB = float(1 << 30)


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of the device and of CuPy's default pool."""

    free_bytes: int
    total_bytes: int
    pool_used_bytes: int  # in live arrays
    pool_total_bytes: int  # held by the pool: live arrays + cached free blocks


@dataclass(frozen=True)
class KVCacheSizing:
    total_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    other_live_bytes: int  # pool arrays that are not weights (small: inv_freq, kernel dummies, ...)
    pool_cached_bytes: int  # free blocks the default pool keeps (split remainders)
    non_pool_bytes: int  # outside CuPy's pool: CUDA context, cuBLAS workspace, kernels, other processes
    activation_peak_bytes: int
    cuda_graph_bytes: int
    bytes_per_block: int
    kv_cache_bytes: int
    num_blocks: int

    def log_fields(self) -> dict[str, Any]:
        """Every number for the `engine.kv_sizing` event, bytes and GiB."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            out[key] = value
            if key.endswith("_bytes") and key != "bytes_per_block":
                out[key.replace("_bytes", "_gib")] = round(value / GIB, 3)
        return out


def size_kv_cache(*, total_bytes: int, gpu_memory_utilization: float, weights_bytes: int, other_live_bytes: int,
                  pool_cached_bytes: int, non_pool_bytes: int, activation_peak_bytes: int, cuda_graph_bytes: int,
                  bytes_per_block: int) -> KVCacheSizing:
    """The KV budget from measured numbers (see the module docstring); ValueError if no block fits."""
    parts = dict(weights_bytes=weights_bytes, other_live_bytes=other_live_bytes, pool_cached_bytes=pool_cached_bytes,
                 non_pool_bytes=non_pool_bytes, activation_peak_bytes=activation_peak_bytes,
                 cuda_graph_bytes=cuda_graph_bytes)
    assert all(v >= 0 for v in parts.values()) and total_bytes > 0 and bytes_per_block > 0, (parts, total_bytes)
    budget = int(total_bytes * gpu_memory_utilization)
    kv_bytes = budget - sum(parts.values())
    num_blocks = max(0, kv_bytes) // bytes_per_block
    if num_blocks < 1:
        detail = ", ".join(f"{k.removesuffix('_bytes')} {v / GIB:.2f} GiB" for k, v in parts.items())
        raise ValueError(
            f"no room for the KV cache on the GPU: gpu_memory_utilization={gpu_memory_utilization} of "
            f"{total_bytes / GIB:.2f} GiB is {budget / GIB:.2f} GiB, and {detail} leave "
            f"{kv_bytes / GIB:.3f} GiB, less than one block ({bytes_per_block} bytes). Raise "
            "gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, or turn CUDA graphs off")
    return KVCacheSizing(total_bytes=total_bytes, gpu_memory_utilization=gpu_memory_utilization,
                         bytes_per_block=bytes_per_block, kv_cache_bytes=kv_bytes, num_blocks=int(num_blocks),
                         **parts)


def array_bytes(arrays: Iterable[Any]) -> int:
    """Bytes of the distinct buffers behind `arrays` (views count once, by their base array)."""
    seen: dict[int, int] = {}
    for a in arrays:
        if a is None:
            continue
        base = a
        while getattr(base, "base", None) is not None:
            base = base.base
        seen[id(base)] = int(base.nbytes)
    return sum(seen.values())


def model_weight_bytes(model: Any) -> int:
    """Bytes of a model's weights on its device: its rank's slices of the architecture's shape table
    (models/registry.py) at the backend's dtype (a tied lm_head is a view of the embedding: counted once)."""
    return registry.weight_bytes(model.config, model.backend.dtype.itemsize, model.shard)


def profile_chunks(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                   block_size: int) -> tuple[list[SeqChunk], int]:
    """A full token budget split as evenly as possible over as many sequences as may run at once
    (each within max_model_len), on disjoint fresh blocks; returns the chunks and the block count."""
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    num_seqs = max(num_seqs, -(-max_num_batched_tokens // max_model_len))
    base, extra = divmod(max_num_batched_tokens, num_seqs)
    chunks, next_block = [], 0
    for i in range(num_seqs):
        n = base + (i < extra)
        nb = -(-n // block_size)
        chunks.append(SeqChunk([0] * n, 0, list(range(next_block, next_block + nb))))
        next_block += nb
    return chunks, next_block


def decode_profile_batch(num_seqs: int, max_model_len: int, block_size: int) -> tuple[np.ndarray, np.ndarray, Any]:
    """Host buffers of a decode batch of `num_seqs` padding rows with block tables as wide as
    max_model_len needs (the width the attention workspace is sized from)."""
    return pack_decode_batch(None, num_seqs, -(-max_model_len // block_size))


def graph_static_bytes(sizes: Sequence[int], max_blocks: int, vocab_size: int) -> int:
    """The static metadata buffers every graph shares (sized for the largest size and table width)
    plus the shared float32 logits output."""
    s = max(sizes)
    return 4 * s * 8 + (2 * s + 1 + s * max_blocks) * 4 + s * vocab_size * 4


def read_device_memory(cp: Any) -> DeviceMemory:
    free, total = cp.cuda.runtime.memGetInfo()
    pool = cp.get_default_memory_pool()
    return DeviceMemory(int(free), int(total), int(pool.used_bytes()), int(pool.total_bytes()))


def _profile_sampling_params():
    from ..sampling_params import SamplingParams

    # top_p without top_k reaches the whole-row nucleus (on the GPU: bisection with [B, V] temporaries);
    # logprobs the top-k selection; the penalty a [B, V] copy.
    return SamplingParams(temperature=1.0, top_p=0.9, logprobs=20, repetition_penalty=1.1)


def profile_kv_cache(model: Any, config: EngineConfig, max_model_len: int, block_size: int,
                     bytes_per_block: int) -> KVCacheSizing:
    """Profile on the GPU (see the module docstring) and size the KV cache."""
    from ..sample.sampler import Sampler

    cp = model.backend.xp
    device = cp.cuda.Device()
    pool = cp.get_default_memory_pool()
    device.synchronize()
    pool.free_all_blocks()
    chunks, num_blocks = profile_chunks(config.max_num_batched_tokens, config.max_num_seqs, max_model_len, block_size)
    decode_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
    graph_sizes = resolve_batch_sizes(config) if config.enable_cuda_graphs else ()
    kv = allocate_kv_caches(model.config, num_blocks, block_size, model.backend, model.shard)
    device.synchronize()
    before = read_device_memory(cp)
    what = (f"max_num_batched_tokens={config.max_num_batched_tokens}, {len(chunks)} sequences, decode batch of "
            f"{decode_seqs} at max_model_len={max_model_len}")
    try:
        batch = build_forward_batch(chunks, block_size)
        logits = model.forward(batch, kv)
        if logits is not None:  # tensor parallelism: only rank 0 gets logits (and samples)
            params = [_profile_sampling_params()] * len(chunks)
            Sampler(0)(logits, params, [None] * len(chunks), [[]] * len(chunks), [[]] * len(chunks), xp=cp)
        del logits
        i64, i32, layout = decode_profile_batch(decode_seqs, max_model_len, block_size)
        model.forward(unpack_batch(cp.asarray(i64), cp.asarray(i32), layout), kv)
        device.synchronize()
    except Exception as e:
        raise RuntimeError(f"the GPU profile run ({what}) failed: {type(e).__name__}: {e}") from e
    after = read_device_memory(cp)
    activation_peak = after.pool_total_bytes - before.pool_total_bytes
    graph_bytes = 0
    if graph_sizes:
        scratch = cp.cuda.MemoryPool()
        try:
            with cp.cuda.using_allocator(scratch.malloc):
                i64, i32, layout = decode_profile_batch(max(graph_sizes), max_model_len, block_size)
                model.forward(unpack_batch(cp.asarray(i64), cp.asarray(i32), layout), kv)
            device.synchronize()
        except Exception as e:
            raise RuntimeError(f"the GPU profile run for CUDA graphs (decode batch of {max(graph_sizes)}) failed: "
                               f"{type(e).__name__}: {e}") from e
        graph_bytes = graph_pool_reserve(int(scratch.total_bytes())) + graph_static_bytes(
            graph_sizes, -(-max_model_len // block_size), model.config.vocab_size)
        scratch.free_all_blocks()
    del kv
    device.synchronize()
    pool.free_all_blocks()
    now = read_device_memory(cp)
    weights = model_weight_bytes(model)
    return size_kv_cache(
        total_bytes=now.total_bytes, gpu_memory_utilization=config.gpu_memory_utilization, weights_bytes=weights,
        other_live_bytes=max(0, now.pool_used_bytes - weights),
        pool_cached_bytes=now.pool_total_bytes - now.pool_used_bytes,
        non_pool_bytes=max(0, now.total_bytes - now.free_bytes - now.pool_total_bytes),
        activation_peak_bytes=activation_peak, cuda_graph_bytes=graph_bytes, bytes_per_block=bytes_per_block)
