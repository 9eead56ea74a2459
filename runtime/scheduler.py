"""The scheduler: one token budget per step, handed out in a fixed order.

    budget = max_num_batched_tokens, at most max_num_seqs running
    1. running decodes          1 token each
    2. running prefills         the rest of the prompt, cut to what the budget has left (chunked prefill)
    3. waiting requests (FCFS)  the same, while the budget, the seat count and the free blocks allow

When the free blocks cannot cover a running request, the newest running request is preempted: its
blocks are freed and it goes back to the front of the waiting queue with num_computed_tokens = 0, to be
recomputed from its prompt and the tokens it already produced (so it yields the same tokens later).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 enable_chunked_prefill: bool = True) -> None:
        self.kv = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and free its blocks at once."""
        request.status = status
        request.timings.finished = time.monotonic()
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.free(request.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.monotonic()
        # Decodes first, then prefills; each group oldest first (the running list is in admission order).
        order = sorted(self.running, key=lambda r: r.is_prefilling)
        scheduled_ids: set[str] = set()
        for request in order:
            if request not in self.running:  # preempted earlier in this loop
                continue
            if budget == 0:
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new):
                victim = next((r for r in reversed(self.running) if r.request_id not in scheduled_ids), None)
                if victim is None:
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                scheduled_ids.add(request.request_id)
                budget -= num_new
        # New requests only when nothing was preempted: memory is tight, let the running ones finish.
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining > budget and not self.enable_chunked_prefill:
                break
            num_new = min(remaining, budget)
            if not self.kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.timings.first_scheduled is None:
                request.timings.first_scheduled = now
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out
