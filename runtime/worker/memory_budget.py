"""What the server may use of the host's memory, known at start and refused when the host lacks it.

    budget = held now (interpreter, libraries, tokenizer, the weights already loaded)
           + KV pool                       CPU: num_kv_blocks x bytes per block (GPU: on the device, 0 here)
           + activations                   the forward's peak at max_num_batched_tokens (estimate below)
           + per-request state             prompts, outputs, logprobs of max_num_seqs running requests

The KV pool and activations are what the settings add after the weights are loaded; they must fit
in what the host has left: /proc/meminfo's MemAvailable and, under systemd or a container, the
headroom of every enclosing cgroup v2 (memory.max - memory.current). A setting that does not fit is
refused at start with the numbers, rather than found out by the OOM killer under load.

The activation figure is an estimate of the numpy path's largest temporaries, not a measurement:
    linear layers     T x (4 hidden + q + 2 kv + 3 intermediate) float32          T = max_num_batched_tokens
    attention         max(prefill: heads x n x L scores + K/V of max(L, 2,048) tokens,  n = min(T, L), L = max_model_len
                                   (or, when more, the numba path's threads x 16 x G x L: each CPU thread's
                                   tile of 16 query tokens x G heads per kv head; cupy_kernels/numba_cpu/prefill.py)
                          decode: the K/V and scores of the whole pool's tokens in one layer)
    logits, sampler   4 x rows x vocab float32                                     rows = min(max_num_seqs, T)
bench/reliability.py checks it: the server's RSS under fuzzing stays below the total.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve.models import registry
from pagedserve.models.config import ModelConfig

from ..config import DEFAULT_CPU_KV_BYTES, EngineConfig

GIB = float(1 << 30)
# Python objects per running request (token lists, detokenizer state, logprob dicts): generous.
PER_REQUEST_BYTES = 4 << 20
# Query tokens per work item of the numba set's long-prefill path (cupy_kernels/numba_prefill.TILE_TOKENS,
# not imported: that would load numba here; tests/runtime/test_memory_budget.py checks they agree).
PREFILL_TILE_TOKENS = 16
# Keys whose K/V panels that path gathers at once for a group of short chunks (numba_prefill.GROUP_KEYS, likewise
# checked); a single longer chunk takes its own L.
PREFILL_GROUP_KEYS = 2048


@dataclass(frozen=True)
class MemoryBudget:
    held_bytes: int  # resident when the budget was taken: interpreter, libraries, weights
    weights_bytes: int  # part of held_bytes (CPU), or on the device (GPU)
    kv_cache_bytes: int  # host bytes of the KV pool (0 when it lives on the GPU)
    activation_bytes: int
    request_state_bytes: int
    # LoRA: the execution slots (models/lora.py) and the host LRU's max_cpu_loras adapters of up to max_lora_rank
    lora_bytes: int = 0

    @property
    def to_add_bytes(self) -> int:
        """What the settings will still take beyond what is held now."""
        return self.kv_cache_bytes + self.activation_bytes + self.request_state_bytes + self.lora_bytes

    @property
    def total_bytes(self) -> int:
        return self.held_bytes + self.to_add_bytes

    def log_fields(self) -> dict[str, float]:
        fields = {k.replace("_bytes", "_gib"): round(v / GIB, 3) for k, v in asdict(self).items()}
        return {**fields, "total_gib": round(self.total_bytes / GIB, 3)}


def activation_bytes(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                     kv_pool_tokens: int, threads: int = 1) -> int:
    """The estimate above; `threads`: the CPU threads the kernels may run on."""
    t = max_num_batched_tokens
    f32 = 4
    linear = t * (4 * cfg.hidden_size + cfg.num_attention_heads * cfg.head_dim + 2 * cfg.kv_size
                  + 3 * cfg.intermediate_size) * f32
    n = min(t, max_model_len)
    group = cfg.num_attention_heads // max(cfg.num_key_value_heads, 1)
    tiles = threads * PREFILL_TILE_TOKENS * group * max_model_len
    prefill = max(cfg.num_attention_heads * n * max_model_len + 2 * n * max_model_len, tiles) * f32 \
        + 2 * max(max_model_len, PREFILL_GROUP_KEYS) * cfg.kv_size * f32
    decode_tokens = min(kv_pool_tokens, max_num_seqs * max_model_len)
    decode = decode_tokens * (cfg.kv_size + cfg.num_attention_heads) * f32
    logits = 4 * min(max_num_seqs, t) * cfg.vocab_size * f32
    return int(linear + max(prefill, decode) + logits)


def weights_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """The weights' size from the config: every tensor of the architecture's shape table (models/registry.py)."""
    return registry.weight_bytes(cfg, itemsize)


def resident_bytes() -> int:
    """This process's resident set size (Linux), 0 where it cannot be read."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def default_cpu_kv_bytes(available: int | None) -> int:
    """The CPU KV pool when kv_cache_memory_bytes is unset: DEFAULT_CPU_KV_BYTES (4 GiB), or half of
    `available` (host_memory_available's bytes) where that is less, so the defaults start on a small
    host or under a tight cgroup instead of being refused. A pool too short for the load preempts and
    recomputes requests, burning cores the applications beside the sidecar share, so the default
    leans to memory, which the pool holds only once its pages are written."""
    if available is None:
        return DEFAULT_CPU_KV_BYTES
    return min(DEFAULT_CPU_KV_BYTES, available // 2 >> 20 << 20)


def host_memory_available() -> tuple[int | None, str]:
    """(bytes this process may still take, where the figure comes from); (None, ...) if unknown."""
    limits: list[tuple[int, str]] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError):
        pass
    for path, headroom in _cgroup_headrooms():
        limits.append((headroom, f"cgroup {path} memory.max"))
    if not limits:
        return None, "unknown"
    return min(limits)


def _cgroup_headrooms() -> list[tuple[str, int]]:
    """memory.max - memory.current of this process's cgroup v2 and each enclosing one with a limit."""
    try:
        rel = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    except (OSError, StopIteration):
        return []
    root = Path("/sys/fs/cgroup")
    out = []
    path = Path(rel.strip() or "/")
    while True:
        d = root / str(path).lstrip("/")
        try:
            limit = (d / "memory.max").read_text().strip()
            if limit != "max":
                out.append((str(path), int(limit) - int((d / "memory.current").read_text())))
        except (OSError, ValueError):
            pass
        if path == path.parent:
            return out
        path = path.parent


def check_fits_host(budget: MemoryBudget, available: int | None, source: str, settings_hint: str) -> None:
    if available is None or budget.to_add_bytes <= available:
        return
    raise ValueError(
        f"the settings need {budget.to_add_bytes / GIB:.2f} GiB more memory than the process holds now "
        f"(KV pool {budget.kv_cache_bytes / GIB:.2f} GiB, activations {budget.activation_bytes / GIB:.2f} GiB, "
        f"request state {budget.request_state_bytes / GIB:.2f} GiB) but only {available / GIB:.2f} GiB is "
        f"available ({source}); lower {settings_hint}")


def lora_bytes(config: EngineConfig, model) -> int:
    """The LoRA slots' bytes (zero pages until an adapter is copied in) and, at most, one slot's worth per adapter
    the host LRU keeps (max_cpu_loras, default max_loras); 0 without enable_lora."""
    slots = getattr(model, "lora", None)
    if slots is None:
        return 0
    cpu_loras = config.max_cpu_loras or config.max_loras
    per_slot = slots.nbytes // config.max_loras
    on_host = slots.xp.__name__ == "numpy"  # on the GPU the slots are device memory (the KV sizing profiles them)
    return (slots.nbytes if on_host else 0) + per_slot * cpu_loras


def check_engine_memory(config: EngineConfig, model_config: ModelConfig, worker, backend, num_blocks: int,
                        max_model_len: int) -> MemoryBudget:
    """Refuse at start settings whose KV pool and activations the host cannot hold; log the budget."""
    import structlog

    c = config
    cpu = not backend.is_gpu
    # CPU tensor parallelism: every rank's share of the pool lives on this host.
    kv_bytes = num_blocks * worker.kv_bytes_per_block() * c.tensor_parallel_size if cpu else 0
    threads = c.cpu_threads if isinstance(c.cpu_threads, int) else os.cpu_count() or 1
    budget = MemoryBudget(
        held_bytes=resident_bytes(), weights_bytes=weights_bytes(model_config, backend.dtype.itemsize),
        kv_cache_bytes=kv_bytes,
        activation_bytes=activation_bytes(model_config, c.max_num_batched_tokens, c.max_num_seqs, max_model_len,
                                          num_blocks * c.block_size, threads) if cpu else 0,
        request_state_bytes=c.max_num_seqs * PER_REQUEST_BYTES, lora_bytes=lora_bytes(c, worker.model))
    available, source = host_memory_available()
    structlog.get_logger("pagedserve.engine").info(
        "engine.memory_budget", available_gib=round(available / 2**30, 3) if available else None,
        available_from=source, **budget.log_fields())
    check_fits_host(budget, available, source, "kv_cache_memory_bytes (or num_kv_blocks), "
                    "max_num_batched_tokens or max_num_seqs")
    return budget
