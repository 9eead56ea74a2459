"""EngineConfig: every knob of the engine, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.cupy_kernels.cuda.ops import ATTN_BLOCK_SIZES
from pagedserve.cupy_kernels.kernel_set import CPU_KERNEL_SETS
from pagedserve.cupy_kernels.kv_layout import normalize_kv_cache_dtype

from .core.sched_policy import make_policy
from .spec_decode.config import SpeculativeConfig

# KV cache on the CPU backend when kv_cache_memory_bytes is unset: 4 GiB, vLLM's CPU default (its
# VLLM_CPU_KVCACHE_SPACE unset), or half of what the host has available where that is less
# (memory_budget.default_cpu_kv_bytes). Pages of the pool are held only once written.
DEFAULT_CPU_KV_BYTES = 4 << 30


@dataclass
class EngineConfig:
    model: str | None = None  # None = the embedded SmolLM2
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_batched_tokens: int = 2048  # the per-step token budget
    max_num_seqs: int = 256  # most requests running at once
    enable_chunked_prefill: bool = True
    # While decodes run, size prefill chunks by cost: a token attending to k keys counts 1 + k / K against
    # max_num_batched_tokens, K = the model's matmul FLOPs per token over its attention FLOPs per key, so
    # steps deep in a long prompt cost what steps at its start do (runtime/core/scheduler.py). False = by count.
    cost_aware_chunking: bool = True
    enable_prefix_caching: bool = True
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # CPU: bytes for the KV pool (None = DEFAULT_CPU_KV_BYTES)
    num_kv_blocks: int | None = None  # overrides the byte budget (tests use it to force preemption)
    gpu_memory_utilization: float = 0.9
    # GPU: replay decode steps from CUDA graphs captured per batch size (runtime/worker/cuda_graphs.py).
    enable_cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] | None = None  # None = cuda_graphs.default_batch_sizes
    seed: int | None = 0
    # Most top logprobs a request may ask for (vLLM's max_logprobs); see runtime/engine/request_limits.py.
    max_logprobs: int = 20
    # Threads of numpy's BLAS (OpenBLAS) and numba's loops for the whole process; None = as started
    # (OPENBLAS_NUM_THREADS, else every core; with tensor_parallel_size N, cores / N per rank). On a host
    # shared with busy processes, fewer threads are faster: "auto" measures step cost and switches between
    # all, half and one of the started threads as the host's load changes (runtime/engine/cpu_threads_tuner.py).
    cpu_threads: int | str | None = None
    # CPU kernels: "numba" (compiled) or "numpy" (the reference); "auto" = numba when it imports, else numpy
    # (cupy_kernels/kernel_set.cpu_kernels).
    cpu_kernels: str = "auto"
    use_weight_cache: bool = True
    # Tensor parallelism (runtime/executor/__init__.py): ranks that each hold 1/N of every layer's heads and MLP.
    tensor_parallel_size: int = 1
    # How ranks 1..N-1 are started: "mp" = local processes (default), "ray" = Ray actors (several hosts).
    distributed_executor_backend: str | None = None  # None = "mp"
    # Longest wait on a collective or a rank's answer before the step fails (a dead rank never hangs us).
    collective_timeout_s: float = 60.0
    # Request lifecycle log events (queued, scheduled, first_token, preempted, finished, aborted):
    # None = off (offline use), False = on without text, True = on with prompts and outputs.
    log_requests: bool | None = None
    # Speculative decoding (runtime/spec_decode/config.py): None = off; a SpeculativeConfig or vLLM's dict,
    # e.g. {"method": "ngram", "num_speculative_tokens": 4} or {"model": PATH, "num_speculative_tokens": 4}.
    speculative_config: SpeculativeConfig | dict | None = None
    # Which waiting request runs next (runtime/core/sched_policy.py): "fcfs", "priority" (the request's priority,
    # lower first; vLLM's) or "fair" (weighted virtual token counters per tenant, within a priority).
    scheduling_policy: str = "fcfs"
    tenant_weights: dict[str, float] | None = None  # "fair": each tenant's share (default 1.0 each)
    # LoRA adapters (runtime/lora/): vLLM's enable_lora, max_loras (execution slots, adapters in one step),
    # max_lora_rank (slots are sized for it), max_cpu_loras (adapters kept read in host memory, LRU; None:
    # max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # What the KV pool stores each value as (vLLM's names, cupy_kernels/kv_layout.py): "auto" (the backend's
    # dtype: float32 on the CPU, float16 on the GPU), "float32", "bfloat16", "float16", or the 8-bit "int8",
    # "fp8_e4m3" ("fp8"), "fp8_e5m2" (a scale per token and kv head); one the kernel set cannot run is refused when
    # the engine starts.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        positive("max_num_batched_tokens")
        positive("max_num_seqs")
        positive("max_model_len", allow_none=True)
        positive("kv_cache_memory_bytes", allow_none=True)
        positive("num_kv_blocks", allow_none=True)
        positive("tensor_parallel_size")
        if self.cpu_threads != "auto":
            if isinstance(self.cpu_threads, str):
                raise ValueError(f"cpu_threads must be a positive integer or 'auto', got {self.cpu_threads!r}")
            positive("cpu_threads", allow_none=True)
        elif self.tensor_parallel_size > 1:
            raise ValueError("cpu_threads='auto' tunes one process's threads: use a number with "
                             f"tensor_parallel_size {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got "
                             f"{self.distributed_executor_backend!r}")
        if isinstance(self.collective_timeout_s, bool) or not isinstance(self.collective_timeout_s, (int, float)) \
                or not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be a positive number of seconds, got "
                             f"{self.collective_timeout_s!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be a non-negative integer, got {self.max_logprobs!r}")
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {self.block_size!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.cpu_kernels not in CPU_KERNEL_SETS:
            raise ValueError(f"cpu_kernels must be one of {CPU_KERNEL_SETS}, got {self.cpu_kernels!r}")
        if self.device == "cuda":
            check_gpu_block_size(self.block_size)
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float)) \
                or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.cuda_graph_batch_sizes is not None:
            sizes = self.cuda_graph_batch_sizes
            if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
                raise ValueError(f"cuda_graph_batch_sizes must be a sequence of batch sizes, got {sizes!r}")
            sizes = tuple(sizes)
            bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or not 0 < s <= self.max_num_seqs]
            if not sizes or bad:
                raise ValueError(f"cuda_graph_batch_sizes must be a non-empty sequence of integers in "
                                 f"[1, max_num_seqs={self.max_num_seqs}], got {self.cuda_graph_batch_sizes!r}")
            self.cuda_graph_batch_sizes = tuple(sorted(set(sizes)))
        for name in ("enable_chunked_prefill", "cost_aware_chunking", "enable_prefix_caching", "enable_cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        make_policy(self.scheduling_policy, self.tenant_weights)  # ValueError names a bad policy or weight
        check_lora_config(self)
        self.kv_cache_dtype = normalize_kv_cache_dtype(self.kv_cache_dtype)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")


def check_gpu_block_size(block_size: int) -> None:
    """The CUDA paged-attention kernels are compiled for a few block sizes; the numpy backend takes any."""
    if block_size not in ATTN_BLOCK_SIZES:
        raise ValueError(f"block_size {block_size} runs on the CPU backend only; on the GPU it must be one of "
                         f"{', '.join(map(str, ATTN_BLOCK_SIZES))}")


def check_lora_config(config: EngineConfig) -> None:
    """The LoRA knobs (vLLM's bounds); the combinations not served yet are refused by name."""
    if not isinstance(config.enable_lora, bool):
        raise ValueError(f"enable_lora must be a bool, got {config.enable_lora!r}")
    for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        value = getattr(config, name)
        if value is None and name == "max_cpu_loras":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        raise ValueError(f"max_cpu_loras ({config.max_cpu_loras}) must be >= max_loras ({config.max_loras})")
