"""Outranking: a waiting request the policy puts before a running one takes its seat at once (sched_policy.py).

A flood of one tenant's long requests fills every seat; a second tenant's request then arrives. FCFS leaves it
waiting until a flood request finishes; fair share admits it in the very next step, ahead of the running
prefills' chunks, preempting the flood's newest request, and the preempted request never takes the seat back
while the newcomer runs. priority does the same for a lower `priority` value (vLLM's priority preemption).
"""

from __future__ import annotations

import pytest

from pagedserve.runtime.core.request import RequestStatus
from pagedserve.runtime.core.sched_policy import FairPolicy, FcfsPolicy, PriorityPolicy

from .test_sched_policy import Sim, _request

FLOOD_SEATS = 4


def _flooded(policy, budget: int = 64, num_blocks: int = 64, steps: int = 6) -> Sim:
    """FLOOD_SEATS of tenant "flood"'s long requests running (every seat taken, more waiting), a few steps in."""
    sim = Sim(policy, budget=budget, max_seqs=FLOOD_SEATS, num_blocks=num_blocks)
    for k in range(3 * FLOOD_SEATS):
        sim.add(_request(f"f{k}", 32, 200, float(k), tenant="flood"))
    for _ in range(steps):
        sim.step()
    assert len(sim.sched.running) == FLOOD_SEATS and len(sim.sched.waiting) == 2 * FLOOD_SEATS
    return sim


def _admitting_step(sim: Sim, rid: str, limit: int = 40):
    """The first step that admits `rid`, and how many steps that took (None, limit: never)."""
    for k in range(1, limit + 1):
        out = sim.step()
        if any(r.request_id == rid for r, _ in out.admitted):
            return out, k
    return None, limit


def test_fair_admits_a_new_tenant_within_steps_preempting_the_flood_fcfs_does_not():
    """The newcomer is lifted to the flood's counter (no banked credit): a tie, and its whole request (8 + 2 * 4)
    is below the flood request's (32 + 2 * 200), so it outranks at once."""
    sim = _flooded(FairPolicy())
    sim.add(_request("chat", 8, 4, 100.0, tenant="chat"))
    out, steps = _admitting_step(sim, "chat")
    assert out is not None and steps == 1, steps
    assert [r.request_id for r, _ in out.admitted] == ["chat"]
    assert len(out.preempted) == 1 and out.preempted[0].tenant == "flood"  # the flood's newest
    assert out.preempted[0].status == RequestStatus.WAITING and out.preempted[0] is sim.sched.waiting[0]
    chunk = next(s for s in out.scheduled if s.request.request_id == "chat")
    assert chunk.num_new_tokens == 8  # its whole prompt at once, ahead of the flood's chunks

    fcfs = _flooded(FcfsPolicy())
    fcfs.add(_request("chat", 8, 4, 100.0, tenant="chat"))
    out, steps = _admitting_step(fcfs, "chat", limit=10)
    assert out is None  # behind the whole flood's queue: no flood request finishes within 10 steps


def test_the_preempted_request_does_not_take_the_seat_back_while_the_newcomer_runs():
    sim = _flooded(FairPolicy())
    chat = _request("chat", 8, 6, 100.0, tenant="chat")
    sim.add(chat)
    first, _ = _admitting_step(sim, "chat")
    assert first is not None and first.preempted
    for _ in range(20):
        if chat.is_finished:
            break
        out = sim.step()
        assert chat in sim.sched.running or chat.is_finished
        assert chat not in out.preempted
    assert chat.status == RequestStatus.FINISHED_LENGTH


def test_fair_does_not_preempt_within_a_tenant_or_for_a_tenant_served_more():
    sim = _flooded(FairPolicy())
    sim.add(_request("f-late", 8, 4, 100.0, tenant="flood"))  # the same tenant: waits its turn
    assert not any(sim.step().preempted for _ in range(5))
    # A tenant whose counter plus its request's whole charge is not below the flood's: no preemption (the
    # margin that stops two tenants from taking a seat from each other in turn).
    sim2 = _flooded(FairPolicy(), steps=2)
    policy = sim2.sched.policy
    big = _request("big", 32, 200, 100.0, tenant="other")
    assert policy.counters["other"] + 32 + 2 * 200 >= policy.counters["flood"]
    sim2.add(big)
    assert not sim2.step().preempted


@pytest.mark.parametrize("priority, preempts", [(-1, True), (0, False), (1, False)])
def test_priority_preempts_for_a_lower_value_only(priority, preempts):
    sim = _flooded(PriorityPolicy())
    sim.add(_request("urgent", 8, 4, 100.0, tenant="flood", priority=priority))
    out = sim.step()
    assert bool(out.preempted) is preempts
    assert ("urgent" in [r.request_id for r, _ in out.admitted]) is preempts


def test_outranking_takes_blocks_too_when_the_pool_is_full():
    """Seats free, blocks gone: the newcomer still gets in at once, by the victim's blocks."""
    sim = Sim(FairPolicy(), budget=64, max_seqs=16, num_blocks=8)
    for k in range(4):
        sim.add(_request(f"f{k}", 30, 200, float(k), tenant="flood"))
    for _ in range(8):
        sim.step()
    assert sim.sched.kv.num_free_blocks < 3 and len(sim.sched.running) < 16
    sim.add(_request("chat", 48, 4, 100.0, tenant="chat"))  # 3 blocks
    out, _ = _admitting_step(sim, "chat", limit=20)
    assert out is not None and out.preempted
    # nothing leaks: every block is held by a running request or free
    sim.sched.finish_request(sim.sched.running[0], RequestStatus.FINISHED_ABORTED)
    for r in list(sim.sched.running) + list(sim.sched.waiting):
        sim.sched.finish_request(r, RequestStatus.FINISHED_ABORTED)
    assert sim.sched.kv.num_free_blocks == 8


@pytest.mark.parametrize("policy", [FcfsPolicy, PriorityPolicy, FairPolicy])
def test_every_policy_counts_each_tenants_positions_once_through_preemptions(policy):
    """tokens[tenant] = the positions its requests computed (prompt + outputs but the last), a recompute after
    preemption not counted again: the per-tenant figure GetServerStats and the metrics show."""
    sim = Sim(policy(), budget=32, max_seqs=8, num_blocks=6)
    requests = [_request(f"{t}{k}", 20 + 3 * k, 12, float(k), tenant=t) for k in range(3) for t in ("a", "b")]
    for r in requests:
        sim.add(r)
    for _ in range(400):
        if not sim.sched.num_unfinished:
            break
        sim.step()
    assert not sim.sched.num_unfinished and sum(r.num_preemptions for r in requests) > 0
    for t in ("a", "b"):
        mine = [r for r in requests if r.tenant == t]
        assert sim.sched.policy.tokens[t] == sum(r.num_prompt_tokens + 12 - 1 for r in mine)
