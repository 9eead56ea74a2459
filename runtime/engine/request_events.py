"""Request lifecycle log events: queued, scheduled, first_token, preempted, finished, aborted.

Off by default (offline use); the sidecar turns them on. Prompts and outputs appear only with
log_requests=True.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

log = structlog.get_logger("pagedserve.engine")


class RequestEvents:
    def __init__(self, mode: bool | None) -> None:
        self.enabled = mode is not None
        self.with_text = bool(mode)

    def queued(self, r) -> None:
        if self.enabled:
            extra = {"prompt": r.prompt} if self.with_text and r.prompt is not None else {}
            log.info("request.queued", request_id=r.request_id, prompt_tokens=r.num_prompt_tokens,
                     max_tokens=r.sampling_params.max_tokens, n=r.sampling_params.n, **extra)

    def scheduled(self, sched) -> None:
        if not self.enabled:
            return
        for r in sched.preempted:
            log.info("request.preempted", request_id=r.request_id, output_tokens=r.num_output_tokens,
                     num_preemptions=r.num_preemptions)
        for r, num_new in sched.admitted:
            if r.num_preemptions == 0:
                t = r.timings
                log.info("request.scheduled", request_id=r.request_id,
                         queue_time_s=round(t.first_scheduled - t.arrival, 6), num_new_tokens=num_new,
                         cached_tokens=r.num_cached_tokens)

    def first_token(self, r, now: float) -> None:
        if self.enabled and r.sample_index == 0:
            log.info("request.first_token", request_id=r.group.request_id if r.group else r.request_id,
                     ttft_s=round(now - r.timings.arrival, 6))

    def ended(self, event: str, r, request_id: str, group: Any = None) -> None:
        if not self.enabled:
            return
        fields: dict[str, Any] = {}
        seqs = group.seqs if group is not None else ([r] if r is not None else [])
        if r is not None:
            t = r.timings
            fields["prompt_tokens"] = r.num_prompt_tokens
            fields["cached_tokens"] = r.num_cached_tokens
            fields["completion_tokens"] = sum(s.num_output_tokens for s in seqs)
            fields["e2e_s"] = round((t.finished or time.monotonic()) - t.arrival, 6)
            if t.first_scheduled is not None:
                fields["queue_time_s"] = round(t.first_scheduled - t.arrival, 6)
            if t.first_token is not None:
                fields["ttft_s"] = round(t.first_token - t.arrival, 6)
                if r.num_output_tokens > 1 and t.finished is not None:
                    fields["tpot_s"] = round((t.finished - t.first_token) / (r.num_output_tokens - 1), 6)
            fields["finish_reason"] = r.finish_reason
            if self.with_text and r.detokenizer is not None:
                fields["output"] = r.detokenizer.output_text
        log.info(event, request_id=request_id, **fields)

