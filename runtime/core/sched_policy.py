"""Scheduling policies: the order the scheduler asks for, never a branch inside it.

The scheduler (scheduler.py) keeps its one token-budget rule and asks its policy three things:

    pick(waiting)          which waiting request to admit next (its beams come with it)
    prefill_key(request)   the order of running prefill chunks under the step's budget (a sort key)
    victim(running)        which running request preemption takes when the free blocks run out
    charge(scheduled)      after a step is planned: the work each request got (fair share's counters)
    outranks(head, victim) whether the waiting `head` goes before the running `victim`: then it is admitted
                           ahead of the running prefills' chunks, preempting `victim` for a seat or blocks

    fcfs       arrival order; preemption takes the newest running request (the scheduler's original rule);
               nobody outranks a running request
    priority   vLLM's: the lowest `priority` value first, ties by arrival; preemption takes the highest
               value, newest first; a waiting request of a lower value outranks (vLLM's priority preemption)
    fair       weighted Virtual Token Counter (VTC; Sheng et al., "Fairness in Serving Large Language Models",
               OSDI 2024, arXiv 2401.00588), within a priority level (priority first, then the counter)

Fair share's cost. Each tenant has a counter c of the service it received, divided by its weight:
a computed prompt token costs w_p (default 1), a computed output token (a decode, draft tokens included)
costs w_q (default 2: a decode step moves a whole KV read for one token, the paper's own choice is
w_p=1, w_q=2). Cached prefix tokens cost nothing (they are not computed); a preempted request's recompute
costs nothing either (each position is charged once, at its first computation), so a preemption never
makes its tenant pay twice. Admission takes the backlogged tenant (one with an admissible waiting request)
of the least counter, its oldest request. A tenant that becomes backlogged is lifted to the least counter
among the backlogged ones (else among the running ones) less the whole charge of the request it brings
(C(r) / weight, below): an idle tenant banks no credit beyond that one request, which goes ahead of the
backlog (what a tenant sending one request at a time needs), and its share goes to the others meanwhile
(work-conserving). Preemption takes the running request of the tenant with
the greatest counter (its newest), and prefill chunks go in counter order.

Outranking. Admission order alone leaves a newly backlogged tenant waiting for a seat that a full batch of
another tenant's long requests frees only as they finish (~1 s at 64 seats on a CPU). So the waiting request
fair share would admit next (the least counter) outranks the running request preemption would take (the
greatest counter), of another tenant, and takes its seat and blocks at once, when its tenant, served that
request in full (C(r) / weight added), would still be at or below the running request's tenant's counter.
No ping-pong: the preempted request's tenant keeps its counter, which stays at or above the newcomer's
through the newcomer's whole request, so it can only outrank back (its own C(r) > 0 added) after that
request is done. Preemption moves no counter (a recompute is free), and the newcomer is the least counter
among the backlogged (pick), so the bound below is unchanged.

The bound. Let C(r) = w_p * prompt(r) + w_q * max_tokens(r) be a request's whole charge, and let
U_X = max_num_seqs * max_r C(r) / w_X bound what tenant X's running requests can still be charged at any
moment (it holds at most max_num_seqs of them). While tenants A and B are both backlogged:
  - their counters only grow, and only through their own running requests;
  - A is admitted only while c_A <= c_B (B has an admissible request, and the least counter goes first;
    when that request cannot be admitted, admission stops for the step rather than skip to A);
  - so after A's last admission at t0, c_A(t) - c_B(t) <= c_A(t0) - c_B(t0) + U_A <= U_A; likewise for B.
When the later of the two becomes backlogged it is lifted to the other's counter less one request's C(r)/w
(<= its own U: it starts at most that far behind), or stays above it, where its own is higher, and then by at
most U of its running set (it was last admitted at or below the least counter).
Over any interval [t1, t2] in which both stay backlogged (a request waiting at every moment, right after each
step's admissions too: a tenant that runs dry and comes back is lifted), with W_X its weighted service in it,
    |W_A / w_A - W_B / w_B| <= |gap(t2)| + |gap(t1)| <= U_A + U_B  (2U for equal weights: VTC's bound).
tests/runtime/test_sched_policy.py checks it on arbitrary arrivals and lengths with hypothesis.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Iterable, Sequence

from .request import Request

POLICIES = ("fcfs", "priority", "fair")
DEFAULT_TENANT = "default"


def tenant_of(request: Request) -> str:
    return request.tenant or DEFAULT_TENANT


class FcfsPolicy:
    """Arrival order: the waiting queue's own (a preempted request goes back to its front).

    Every policy counts each tenant's computed tokens (`tokens`: prompt and output positions, each once: a
    recompute after preemption is not counted again), which the engine's stats show per tenant."""

    name = "fcfs"

    def __init__(self) -> None:
        self.tokens: dict[str, int] = defaultdict(int)
        # Positions of each sequence counted so far (a recompute after preemption is free).
        self._charged: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()

    def _first_computed(self, request: Request, num_real_tokens: int) -> tuple[int, int]:
        """(prompt, output) positions this step computes for the first time; counts them in `tokens`."""
        start = request.num_computed_tokens
        end = start + num_real_tokens
        done = max(self._charged.get(request, 0), start)
        if end <= done:
            return 0, 0
        new_prompt = max(0, min(end, request.num_prompt_tokens) - done)
        self._charged[request] = end
        self.tokens[tenant_of(request)] += end - done
        return new_prompt, end - done - new_prompt

    def pick(self, waiting: Iterable[Request]) -> Request | None:
        return next((r for r in waiting if not r.waiting_for_grammar), None)

    def prefill_key(self, request: Request) -> tuple:
        return ()  # the running list's admission order (the sort is stable)

    def victim(self, running: Sequence[Request]) -> Request:
        return running[-1]

    def on_waiting(self, request: Request, backlogged: Iterable[str], running: Iterable[Request]) -> None:
        pass

    def outranks(self, head: Request, victim: Request) -> bool:
        return False

    def charge(self, request: Request, num_new_tokens: int, num_real_tokens: int) -> None:
        self._first_computed(request, num_real_tokens)


class PriorityPolicy(FcfsPolicy):
    """vLLM's priority scheduling: the lowest `priority` first, ties by arrival."""

    name = "priority"

    def _key(self, r: Request) -> tuple:
        return (r.priority, r.arrival_time)

    def pick(self, waiting: Iterable[Request]) -> Request | None:
        return min((r for r in waiting if not r.waiting_for_grammar), key=self._key, default=None)

    def prefill_key(self, request: Request) -> tuple:
        return self._key(request)

    def outranks(self, head: Request, victim: Request) -> bool:
        return head.priority < victim.priority

    def victim(self, running: Sequence[Request]) -> Request:
        # The least urgent, newest first: max over (priority, arrival), the last one in running order on ties.
        best = running[-1]
        for r in reversed(running):
            if self._key(r) > self._key(best):
                best = r
        return best


class FairPolicy(PriorityPolicy):
    """Weighted VTC within each priority level (module docstring: costs, lift, bound)."""

    name = "fair"

    def __init__(self, weights: dict[str, float] | None = None, prompt_cost: float = 1.0,
                 output_cost: float = 2.0) -> None:
        for name, w in (weights or {}).items():
            if not w > 0:
                raise ValueError(f"weight of tenant {name!r} must be positive, got {w!r}")
        if not prompt_cost > 0 or not output_cost > 0:
            raise ValueError(f"prompt_cost and output_cost must be positive, got {prompt_cost!r}, {output_cost!r}")
        super().__init__()
        self.weights = dict(weights or {})
        self.prompt_cost = prompt_cost
        self.output_cost = output_cost
        self.counters: dict[str, float] = defaultdict(float)  # service / weight
        self.served: dict[str, float] = defaultdict(float)  # weighted service, not divided (bench, tests)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def _key(self, r: Request) -> tuple:
        return (r.priority, self.counters[tenant_of(r)], r.arrival_time)

    def victim(self, running: Sequence[Request]) -> Request:
        return super().victim(running)  # the greatest (priority, counter, arrival)

    def outranks(self, head: Request, victim: Request) -> bool:
        if head.priority != victim.priority:
            return head.priority < victim.priority
        tenant = tenant_of(head)
        if tenant == tenant_of(victim):
            return False
        mine, theirs = self.counters[tenant], self.counters[tenant_of(victim)]
        return mine + self._whole(head) / self.weight(tenant) <= theirs

    def _whole(self, r: Request) -> float:
        """C(r): everything the request can be charged, its prompt and max_tokens outputs."""
        return self.prompt_cost * r.num_prompt_tokens + self.output_cost * r.sampling_params.max_tokens

    def on_waiting(self, request: Request, backlogged: Iterable[str], running: Iterable[Request]) -> None:
        """`request` joins the waiting queue; if its tenant had nothing waiting, lift its counter (no banked
        credit but this request's)."""
        tenant = tenant_of(request)
        backlogged = set(backlogged)
        if tenant in backlogged:  # already backlogged: its counter stands (a lift now would lose it service)
            return
        others = [self.counters[t] for t in backlogged]
        if not others:
            others = [self.counters[tenant_of(r)] for r in running if tenant_of(r) != tenant]
        if others:
            self.counters[tenant] = max(self.counters[tenant], min(others) - self._whole(request) / self.weight(tenant))

    def charge(self, request: Request, num_new_tokens: int, num_real_tokens: int) -> None:
        """Charge the positions this step computes for the first time: prompt ones w_p, output ones w_q;
        draft tokens (num_new_tokens - num_real_tokens) are output work, w_q each."""
        new_prompt, new_output = self._first_computed(request, num_real_tokens)
        cost = self.prompt_cost * new_prompt + self.output_cost * (new_output + num_new_tokens - num_real_tokens)
        if cost:
            tenant = tenant_of(request)
            self.served[tenant] += cost
            self.counters[tenant] += cost / self.weight(tenant)


def make_policy(name: str, weights: dict[str, float] | None = None) -> FcfsPolicy:
    if name == "fcfs":
        return FcfsPolicy()
    if name == "priority":
        return PriorityPolicy()
    if name == "fair":
        return FairPolicy(weights)
    raise ValueError(f"scheduling_policy must be one of {list(POLICIES)}, got {name!r}")
