"""Request: everything the engine knows about one generation, as plain counters and lists.

The scheduler moves counters (`num_computed_tokens`) and never touches arrays. A request's tokens are
`prompt_token_ids + output_token_ids`; those below `num_computed_tokens` have K/V in the cache.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its prompt's blocks are coming from a prefill instance
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class RequestTimings:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    cache_salt: str | None = None  # keeps tenants' prefix-cache entries apart
    tenant: str | None = None  # who asked (the sidecar's tenants file); None = the one default tenant
    priority: int = 0  # --scheduling-policy priority/fair: lower runs first (vLLM's)
    generator: np.random.Generator | None = None
    detokenizer: Any = None  # runtime.detokenizer.IncrementalDetokenizer, set by the engine
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    timings: RequestTimings | None = None
    sample_index: int = 0  # which of the group's samples this sequence is
    group: Any = None  # the runtime.sequence_group.SequenceGroup it belongs to
    kv_export: Any = None  # runtime.kv_connector.KVExport: a prefill instance sends its blocks on
    matcher: Any = None  # structured outputs: this sequence's llguidance.LLMatcher (structured_output.py)
    # Speculative decoding: draft tokens proposed for the next step (verified there, never part of
    # all_token_ids until accepted), the draft model's distributions they were drawn from ([k, V],
    # None for n-gram drafts: a one-hot q), and the proposer's per-sequence record (spec_decode.py).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: Any = None
    spec_state: Any = None
    lora_request: Any = None  # runtime.lora.LoRARequest: the adapter its rows run with; None: the base model

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        if self.timings is None:
            self.timings = RequestTimings(arrival=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """True while more than the newest token is still to be computed (a prompt, or a recompute).

        Draft tokens are not in all_token_ids, so a speculative verify step (the newest token plus k
        drafts) is still a decode here.
        """
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def waiting_for_grammar(self) -> bool:
        """Structured outputs: the request's grammar is still compiling, so it may not be scheduled yet."""
        grammar = self.group.grammar if self.group is not None else None
        return grammar is not None and not grammar.done()

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    def banned_token_ids(self, num_extra_outputs: int = 0) -> list[int]:
        """Until min_tokens are out, end-of-sequence and stop tokens may not be sampled.

        num_extra_outputs: tokens beyond the current output (the drafts before a verify row).
        """
        params = self.sampling_params
        if self.num_output_tokens + num_extra_outputs >= params.min_tokens:
            return []
        banned = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            banned += list(self.eos_token_ids)
        return banned

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
