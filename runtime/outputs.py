"""What the engine hands back: per-request outputs fit for streaming, and engine stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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


@dataclass
class EngineStats:
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
    kv_transfer: Any = None  # runtime.kv_connector.KVTransferStats (disaggregated prefill/decode)
    # Speculative decoding since start ("" = off): drafts proposed and accepted, and tokens emitted per
    # verify step (1 + accepted / verify steps).
    spec_method: str = ""
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_mean_accepted_length: float = 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def kv_block_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total if self.num_kv_blocks_total else 0.0
