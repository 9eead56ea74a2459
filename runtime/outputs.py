"""What the engine hands back: per-request outputs fit for streaming, engine stats, and the loaded engine's facts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kv_transfer.kv_connector import KVTransferStats


@dataclass
class CompletionOutput:
    """One sample of a request (index 0 unless n > 1). Cumulative fields plus this step's delta."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None  # per token: chosen and top-N ids -> logprob, when asked
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    # A finished sample ("stop") of a JSON Schema that was not enforced exactly, checked against the whole
    # schema: how it breaks it ("$['key']: message"); empty when it conforms or nothing needed checking.
    schema_violations: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None  # set on the final output of a request that failed inside the engine
    # What of the request's JSON Schema is approximated or not enforced ("keyword: what happens"), on every
    # output of the request; empty when everything is enforced exactly.
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TenantStats:
    """One tenant's share of the engine now (its requests running and queued) and since start (its computed
    prompt + output tokens, each position once; under fair share its weighted service and virtual counter)."""

    name: str
    num_running: int = 0
    num_waiting: int = 0
    tokens_served: int = 0
    weight: float = 1.0
    fair_share_served: float = 0.0  # w_p * prompt + w_q * output tokens (runtime/core/sched_policy.py); 0 unless fair
    fair_share_counter: float = 0.0  # fair_share_served / weight: what fair share compares between tenants


@dataclass
class EngineStats:
    """The one schema of the engine's figures: runtime/engine/stats.py fills it, the logs, the sidecar's
    GetServerStats (sidecar/stats_schema.py: the wire names, and the fields kept off the wire) and its
    Prometheus metrics (sidecar/metrics.py: ENGINE_METRICS) read it. tests/sidecar/test_stats_schema.py fails
    when a field added here reaches neither the wire nor the metrics without being declared left out."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    kv_token_slot_utilization: float  # tokens held / token slots in allocated blocks
    output_tokens_per_s: float
    total_tokens_per_s: float
    num_preemptions: int
    prefix_cache_hit_rate: float = 0.0  # cached prompt tokens / prompt tokens, since start
    prefix_cache_request_hit_rate: float = 0.0  # requests with a hit / requests, since start
    num_shared_blocks: int = 0  # referenced by more than one sequence (forks, prefix hits)
    num_exclusive_blocks: int = 0  # referenced by exactly one sequence
    kv_bytes_used: int = 0  # bytes of the blocks in use
    kv_bytes_without_sharing: int = 0  # what the live block tables would take if nothing were shared
    kv_transfer: KVTransferStats | None = None  # disaggregated prefill/decode counters
    # Speculative decoding since start ("" = off): drafts proposed and accepted, and tokens emitted per
    # verify step (1 + accepted / verify steps).
    spec_method: str = ""
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_mean_accepted_length: float = 0.0
    # LoRA (runtime/lora/manager.py; 0 when off): adapters loaded and resident now; since start, admissions
    # that found their adapter resident, copies into a slot, slots taken from an unheld resident adapter.
    lora_loaded: int = 0
    lora_resident: int = 0
    lora_hits: int = 0
    lora_loads: int = 0
    lora_evictions: int = 0
    # Per tenant (runtime/core/sched_policy.py): every tenant with requests in the engine or served since start;
    # one "default" row when no tenants file names callers.
    tenants: tuple[TenantStats, ...] = ()

    def tenant(self, name: str) -> TenantStats:
        """`name`'s row (an empty one when it has had nothing in this engine)."""
        return next((t for t in self.tenants if t.name == name), TenantStats(name))

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def kv_block_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total if self.num_kv_blocks_total else 0.0


@dataclass(frozen=True)
class EngineInfo:
    """What a loaded engine is and runs on (the sidecar's GetModelInfo, less the name). All fixed once it is
    built but blas_threads, which follows the CPU thread tuner."""

    architecture: str  # the Hugging Face architecture, e.g. "LlamaForCausalLM"
    max_model_len: int
    vocab_size: int
    block_size: int  # tokens per KV cache block
    dtype: str  # compute and KV cache dtype, e.g. "float32"
    backend: str  # "numpy" or "cupy"
    num_kv_blocks: int
    kernels: str  # the backend's kernel set: "numba", "numpy" or "cuda"
    blas_kernel: str  # numpy's BLAS kernel ("SkylakeX", ...); "" when unknown
    blas_threads: int  # threads the CPU backend runs at now; 0 when unknown
    numba_code_path: str  # "avx512", "avx2", "baseline"; "" on the GPU
    kv_cache_dtype: str = ""  # what the KV pool stores ("auto" resolved): "float32", "bfloat16", "float16", ...
