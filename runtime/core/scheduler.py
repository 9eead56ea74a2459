"""The scheduler: one token budget per step, handed out in a fixed order.

    budget = max_num_batched_tokens, at most max_num_seqs running
    1. running decodes          1 token each, plus its draft tokens when it speculates (a lookahead:
                                as many drafts as the budget and the free blocks allow, else none)
    2. running prefills         the rest of the prompt, cut to what the budget has left (chunked prefill)
    3. waiting requests         the same, while the budget, the seat count and the free blocks allow

Which waiting request comes next, the order of the running prefills' chunks and which request preemption
takes are the policy's (sched_policy.py: fcfs, priority, fair); the rules below are fcfs's.

Cost-aware chunking (on unless keys_per_token is None): a token's attention grows with the keys before
it, so a chunk deep in a long prompt costs more than one at its start. While the step carries decodes,
whose streams wait for it, a prefill chunk is sized by cost, not count: a token attending to k keys counts
1 + k / keys_per_token against the budget, keys_per_token being how many keys cost one token's weight
matmuls (the model's matmul FLOPs per token over its attention FLOPs per key: 3,072 for SmolLM2-135M,
26,624 for Llama-3-8B; over the kernels' attention cost: numba's attention FLOP costs 2.3 matmul FLOPs, so
1,336 for SmolLM2 there). Every such step then costs about what a budget of tokens costs at the start of a
prompt. Decodes still count 1 each; the chunks after the first see what the earlier ones' cost left (a
chunk that cannot fit one token waits); a step without decodes takes whole budget-sized chunks.

When the free blocks cannot cover a running request, the newest running request is preempted: its
blocks are freed and it goes back to the front of the waiting queue with num_computed_tokens = 0, to be
recomputed from its prompt and the tokens it already produced (so it yields the same tokens later).

A request with structured outputs is passed over (it keeps its place) until its grammar is compiled.
Speculative decoding: a decode with drafts (request.spec_token_ids) is scheduled as 1 + k tokens and
gets slots for all of them; after verification rollback_rejected moves num_computed_tokens past the
accepted drafts only and truncates the block table, releasing the slots of the rejected ones.

Only the scheduler changes KV state (through the KV manager): admission, preemption and finishing here;
after a step the engine reports what was computed (commit_computed), which drafts were kept
(rollback_rejected) and which samples or beams split off (fork); a decode instance's remote prefill
admits through start_remote_kv. Copy-on-write copies leave with the step (SchedulerOutput.blocks_to_copy).

With prefix caching, a request being admitted first takes the longest cached prefix of full blocks
(those tokens count as computed), so a shared system prompt, or a preempted request's own freed but
still cached blocks, is not computed again.
"""

from __future__ import annotations

import math
import time
from collections import deque

from .chunking import attention_cost, chunk_within
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus
from .sched_output import ScheduledRequest, SchedulerOutput
from .sched_policy import FcfsPolicy, tenant_of

__all__ = ["Scheduler", "ScheduledRequest", "SchedulerOutput", "chunk_within"]


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 enable_chunked_prefill: bool = True, keys_per_token: float | None = None,
                 policy: FcfsPolicy | None = None) -> None:
        self.kv = kv_manager
        self.policy = policy or FcfsPolicy()  # admission order, prefill-chunk order, preemption victim
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        # Cost-aware chunking (module docstring): None = chunks sized by token count only.
        if keys_per_token is not None and not keys_per_token > 0:
            raise ValueError(f"keys_per_token must be positive or None, got {keys_per_token!r}")
        self.keys_per_token = keys_per_token
        self._step_extra_cost = 0.0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Prompt blocks computed by a prefill instance (disaggregated): held, not scheduled until the KV arrives.
        self.waiting_for_kv: dict[str, Request] = {}
        # Called with a sequence id when it stops running: state kept beside its KV blocks (the draft's cache).
        self.release_hooks: list = []
        # Prefix cache hit counters (first admissions only).
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0
        self.num_admitted = 0
        self.num_admitted_with_hit = 0
        # LoRA (runtime/lora/manager.py; None: off): a request waits until its adapter has a slot (lora.admits).
        self.lora = None

    def add_request(self, request: Request) -> None:
        self.policy.on_waiting(request, (tenant_of(r) for r in self.waiting), self.running)
        self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and free its blocks at once."""
        request.status = status
        request.timings.finished = time.monotonic()
        if request in self.running:
            self.running.remove(request)
        elif self.waiting_for_kv.pop(request.request_id, None) is None:  # not receiving its KV either
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.free(request.request_id)
        self._release(request)

    def _release(self, request: Request) -> None:
        request.spec_token_ids, request.spec_draft_probs = [], None
        for hook in self.release_hooks:
            hook(request.request_id)

    def add_running(self, request: Request) -> None:
        """A sequence forked from a running one (parallel samples, beams): it runs from the next step."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def add_waiting_for_kv(self, request: Request) -> None:
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_kv[request.request_id] = request

    def kv_arrived(self, request: Request) -> None:
        """Its blocks are in place and num_computed_tokens counts them: schedule the rest like a running prefill."""
        del self.waiting_for_kv[request.request_id]
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def kv_failed(self, request: Request) -> None:
        """The transfer failed and its blocks are freed: prefill it here, ahead of newer arrivals."""
        del self.waiting_for_kv[request.request_id]
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    # -- KV state after a step: the engine reports, the scheduler (through the KV manager) changes it ----------

    def commit_computed(self, request: Request, num_tokens: int) -> None:
        """`num_tokens` more of the request's tokens have their K/V in its blocks: count them, and offer its
        full blocks to the prefix cache."""
        request.num_computed_tokens += num_tokens
        self.kv.cache_full_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens,
                                  self._prefix_key(request))
        # A sliding-window group's blocks that no future query reads go back to the pool now (hashed above).
        self.kv.release_outside_window(request.request_id, request.num_computed_tokens)

    def rollback_rejected(self, request: Request, num_accepted: int) -> None:
        """After a verify step: the accepted drafts' K/V counts as computed, the rejected drafts' slots are
        released. all_token_ids holds only accepted tokens, so no hash ever covers a rejected one."""
        if request.is_finished:  # finishing already freed every block
            return
        request.num_computed_tokens += num_accepted
        self.kv.truncate(request.request_id, request.num_computed_tokens)
        self.kv.cache_full_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens,
                                  self._prefix_key(request))
        self.kv.release_outside_window(request.request_id, request.num_computed_tokens)

    def fork(self, parent: Request, child: Request) -> None:
        """`child` (a parallel sample or a beam) shares every block of the running `parent` (copy-on-write)
        and runs from the next step."""
        self.kv.fork(parent.request_id, child.request_id)
        child.num_computed_tokens = parent.num_computed_tokens
        self.add_running(child)

    def start_remote_kv(self, request: Request, num_blocks: int) -> tuple[int, list[int]] | str:
        """Disaggregated serving: hold `request` while a prefill instance computes its first `num_blocks`
        prompt blocks. Its cached prefix is shared, the rest allocated now; returns (first block to fetch,
        destination block ids), or why it is to be queued as usual instead: "cached" (nothing is missing)
        or "no free blocks for the transfer"."""
        cached = self.kv.find_cached_prefix(request.prompt_token_ids, self._prefix_key(request))
        if len(cached) >= num_blocks:
            return "cached"
        if not self.kv.allocate_with_prefix(request.request_id, cached,
                                            (num_blocks - len(cached)) * self.kv.block_size):
            return "no free blocks for the transfer"
        request.num_cached_tokens = len(cached) * self.kv.block_size
        request.timings.first_scheduled = time.monotonic()
        self.add_waiting_for_kv(request)
        return len(cached), self.kv.block_table(request.request_id)[len(cached):]

    def _prefix_key(self, request: Request) -> object:  # cache_salt, adapter (never shared); LongRoPE: factor set
        lora = request.lora_request
        return self.kv.prefix_key(request.cache_salt, request.num_prompt_tokens, lora and lora.cache_key)

    def remote_kv_landed(self, request: Request, num_blocks: int) -> None:
        """Its first `num_blocks` blocks arrived: count them computed, cache them, schedule the rest."""
        request.num_computed_tokens = 0
        self.commit_computed(request, num_blocks * self.kv.block_size)
        self.kv_arrived(request)

    def remote_kv_failed(self, request: Request) -> None:
        """The transfer failed or could not start: free its blocks and prefill it here."""
        self.kv.free(request.request_id)
        self.kv_failed(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv)

    def _preempt(self, request: Request, out: SchedulerOutput) -> list[Request]:
        """Preempt `request` and, for a beam, its running sibling beams: beams move together, because a
        beam can only advance once all its siblings have proposed their next tokens."""
        group = request.group
        members = [request]
        if group is not None and group.beam is not None:
            members = [m for m in group.seqs if m in self.running] or [request]
        for m in members:
            out.scheduled = [s for s in out.scheduled if s.request is not m]  # un-schedule: its slots go too
            self.running.remove(m)
            self.kv.free(m.request_id)
            self._release(m)
            m.status = RequestStatus.WAITING
            m.num_computed_tokens = 0
            m.num_preemptions += 1
            self.policy.on_waiting(m, (tenant_of(r) for r in self.waiting), self.running)
            self.waiting.appendleft(m)
            out.preempted.append(m)
        return members

    def _budget(self, out: SchedulerOutput) -> int:
        """What the step has left: its tokens, less what cost-sized chunks spent beyond their token count."""
        return self.max_num_batched_tokens - out.num_batched_tokens - math.ceil(self._step_extra_cost)

    def _chunk(self, budget: int, context: int, remaining: int, with_decodes: bool) -> int:
        """Tokens of a prefill chunk: what the budget leaves, by count, or by cost while decodes wait on the step
        (the step's first such chunk gets a token whatever it costs, so a prompt always progresses)."""
        if self.keys_per_token is None or not with_decodes or not self.enable_chunked_prefill:
            return min(remaining, budget)
        n = chunk_within(budget, context, remaining, self.keys_per_token)
        extra = attention_cost(n, context, self.keys_per_token)
        if n + extra > budget and self._step_extra_cost > 0:
            return 0
        self._step_extra_cost += extra
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        now = time.monotonic()
        # Cost-sized chunks' cost beyond their token counts, so far this step (kept when a chunk is un-scheduled
        # again: the rest of the step is then sized a little small).
        self._step_extra_cost = 0.0
        # Decodes first (in admission order), then prefills in the policy's order (fcfs: admission order).
        with_decodes = None  # whether the step carries decodes: known once the prefills' turn comes
        policy = self.policy
        order = lambda r: (True, policy.prefill_key(r)) if r.is_prefilling else (False,)  # noqa: E731
        for request in sorted(self.running, key=order):
            if request not in self.running:  # preempted earlier in this loop
                continue
            budget = self._budget(out)
            if budget <= 0:
                break
            remaining = request.num_tokens - request.num_computed_tokens
            if request.is_prefilling:
                if with_decodes is None:
                    with_decodes = self._has_decodes(out)
                    self._admit_outranking(out, now, with_decodes)  # before the running prefills' chunks
                    if request not in self.running or self._budget(out) <= 0:
                        continue
                    budget = self._budget(out)
                num_new = self._chunk(budget, request.num_computed_tokens, remaining, with_decodes)
            else:
                num_new = min(remaining, budget)
            if num_new == 0:  # a beam waiting for its siblings' proposals, or a chunk the step's cost leaves no room
                continue
            spec = request.spec_token_ids[: budget - 1] if not request.is_prefilling else []
            try:
                while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens,
                                                 num_new + len(spec)):
                    if spec:  # the lookahead goes before anyone is preempted for it
                        spec = []
                        continue
                    if request in self._preempt(policy.victim(self.running), out):  # fcfs: newest first
                        break
                else:
                    if len(spec) < len(request.spec_token_ids):
                        request.spec_token_ids = list(spec)
                        if request.spec_draft_probs is not None:
                            request.spec_draft_probs = request.spec_draft_probs[: len(spec)] if spec else None
                    out.scheduled.append(ScheduledRequest(request, num_new + len(spec), list(spec)))
            except Exception as e:
                self._fail([request], e, out)
        if with_decodes is None:  # no running prefill: the loop did not get to it
            self._admit_outranking(out, now, self._has_decodes(out))
        # New requests only when nothing was preempted: memory is tight, let the running ones finish.
        with_decodes = self._has_decodes(out)
        while self.waiting and not out.preempted and self._budget(out) > 0:
            unit = self._admission_unit()
            if unit is None:
                break
            try:
                if not self._admit(unit, out, now, with_decodes):
                    break
            except Exception as e:
                self._fail(unit, e, out)
        while self.lora is not None and self.lora.failed:  # its adapter could not be read: that request fails alone
            request, error = self.lora.failed.pop()
            self._fail([request], error, out)
        out.blocks_to_copy = self.kv.take_pending_copies()
        for s in out.scheduled:  # fair share counts the work each tenant got (admissions were counted already)
            policy.charge(s.request, s.num_new_tokens, s.num_real_tokens)
        return out

    @staticmethod
    def _has_decodes(out: SchedulerOutput) -> bool:
        return any(not s.request.is_prefilling for s in out.scheduled)

    def _fail(self, requests: list[Request], error: Exception, out: SchedulerOutput) -> None:
        """Take requests whose scheduling raised out of this step and the queues, and free their blocks."""
        for r in requests:
            out.scheduled = [s for s in out.scheduled if s.request is not r]
            out.admitted = [a for a in out.admitted if a[0] is not r]
            self.finish_request(r, RequestStatus.FINISHED_ABORTED)
            out.failed.append((r, error))

    def _admit_outranking(self, out: SchedulerOutput, now: float, with_decodes: bool) -> None:
        """Admit the policy's next requests that outrank the running request preemption would take (a newly
        backlogged tenant under fair share, a lower `priority` value), ahead of the running prefills' chunks,
        preempting that request whenever a seat or blocks are missing. fcfs: nobody outranks, nothing happens."""
        while self.waiting and self.running and self._budget(out) > 0:
            unit = self._admission_unit()
            if unit is None or not self.policy.outranks(unit[0], self.policy.victim(self.running)):
                return
            try:
                for _ in range(len(self.running) + 1):  # each try preempts one more victim
                    if self._admit(unit, out, now, with_decodes):
                        break
                    victim = self.policy.victim(self.running) if self.running else None
                    if victim is None or not self.policy.outranks(unit[0], victim):
                        return
                    self._preempt(victim, out)
                else:
                    return
            except Exception as e:
                self._fail(unit, e, out)

    def _admission_unit(self) -> list[Request] | None:
        """The policy's next request whose grammar (if any) is compiled and adapter (if any) has a slot, with its
        sibling beams (a beam group is admitted whole or not at all). None: every waiting request still waits."""
        passed: set[int] = set()  # waiting for an adapter's slot: the requests behind them still run
        while (head := self.policy.pick(r for r in self.waiting if id(r) not in passed)) is not None:
            if self.lora is None or self.lora.admits(head):
                break
            passed.add(id(head))
        if head is None:
            return None
        if head.group is None or head.group.beam is None:
            return [head]
        return [head] + [r for r in self.waiting if r is not head and r.group is head.group]

    def _admit(self, unit: list[Request], out: SchedulerOutput, now: float, with_decodes: bool) -> bool:
        if self.running and len(self.running) + len(unit) > self.max_num_seqs:
            return False
        planned: list[tuple[Request, int, int]] = []  # (request, cached tokens, new tokens)
        for k, request in enumerate(unit):
            cached = self.kv.find_cached_prefix(request.all_token_ids, self._prefix_key(request))
            num_cached = len(cached) * self.kv.block_size
            remaining = request.num_tokens - num_cached
            share = self._budget(out) // (len(unit) - k)  # split the budget across a beam group
            if share <= 0 or (remaining > share and not self.enable_chunked_prefill):
                break
            num_new = self._chunk(share, num_cached, remaining, with_decodes)
            if num_new == 0:  # the step's cost is spent
                break
            if not self.kv.allocate_with_prefix(request.request_id, cached, num_new):
                break
            planned.append((request, num_cached, num_new))
            out.scheduled.append(ScheduledRequest(request, num_new))
        if len(planned) < len(unit):  # roll back a partly admitted group
            for request, _, _ in planned:
                self.kv.free(request.request_id)
                out.scheduled = [s for s in out.scheduled if s.request is not request]
            return False
        for request, num_cached, num_new in planned:
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:  # count hits of the prompt, not of a recompute
                request.num_cached_tokens = num_cached
                self.num_prompt_tokens += request.num_prompt_tokens
                self.num_cached_prompt_tokens += num_cached
                self.num_admitted += 1
                self.num_admitted_with_hit += num_cached > 0
            self.waiting.remove(request)
            self.policy.charge(request, num_new, num_new)  # now: the next pick this step sees it (fair share)
            request.status = RequestStatus.RUNNING
            if request.timings.first_scheduled is None:
                request.timings.first_scheduled = now
            self.running.append(request)
            out.admitted.append((request, num_new))
        return True
