"""What a scheduler step hands the engine: the requests it runs, with how many tokens each, and what moved.

Kept apart from the scheduler (scheduler.py) so the engine, the model runner and the output processor read a
plain record, and the scheduler's module holds only its rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # includes the draft tokens below
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified this step (after the newest token)

    @property
    def num_real_tokens(self) -> int:
        """The sequence's own new tokens (prompt chunk or newest token), without the drafts after them."""
        return self.num_new_tokens - len(self.spec_token_ids)

    @property
    def completes_prompt(self) -> bool:
        """This step computes the sequence's last known token, so it samples (decodes always do)."""
        return self.request.num_computed_tokens + self.num_real_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[tuple[Request, int]] = field(default_factory=list)  # moved from waiting this step
    # Requests whose scheduling raised: already out of the queues with their blocks freed; the engine
    # fails their groups. One request's bug costs the others nothing.
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    # Copy-on-write block copies (src, dst) the device makes before this step's forward.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    # (the list counted, its length then, their tokens): the scheduler asks after every request it schedules, and
    # summing the whole list each time made a step of N requests cost O(N^2) (~28k additions a step at 256).
    # `scheduled` only grows by appends or is replaced by a new list; either is seen here.
    _counted: tuple[list, int, int] = field(default=([], 0, 0), repr=False, compare=False)

    @property
    def num_batched_tokens(self) -> int:
        counted, n, total = self._counted
        if counted is not self.scheduled or n > len(self.scheduled):
            n, total = 0, 0
        for i in range(n, len(self.scheduled)):
            total += self.scheduled[i].num_new_tokens
        self._counted = (self.scheduled, len(self.scheduled), total)
        return total

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
