"""EngineStats of a running engine: its queues, the KV pool's use and sharing, throughput over a recent window,
prefix-cache hits, speculation and KV-transfer counters. One snapshot feeds the logs, the wire and the metrics."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from pagedserve.models.kv_cache import kv_bytes_per_block

from ..kv_transfer.kv_connector import KVTransferStats
from ..core.sched_policy import tenant_of
from ..outputs import EngineStats, TenantStats

if TYPE_CHECKING:
    from .llm_engine import LLMEngine


class Throughput:
    """Tokens of recent steps, for rates over a window."""

    def __init__(self) -> None:
        self._steps: deque[tuple[float, int, int]] = deque()  # (time, output tokens, all tokens)

    def add(self, now: float, output_tokens: int, all_tokens: int) -> None:
        self._steps.append((now, output_tokens, all_tokens))

    def rates(self, now: float, window_s: float) -> tuple[float, float]:
        """(output tokens/s, all tokens/s) over the steps of the last `window_s` seconds."""
        steps = self._steps
        while steps and now - steps[0][0] > window_s:
            steps.popleft()
        span = now - steps[0][0] if len(steps) > 1 else 0.0
        if span <= 0:
            return 0.0, 0.0
        return sum(x[1] for x in steps) / span, sum(x[2] for x in steps) / span


def engine_stats(engine: LLMEngine, window_s: float = 10.0) -> EngineStats:
    """A snapshot of `engine` now; throughput over the last `window_s` seconds. Call it on the engine's thread."""
    out_tps, all_tps = engine.throughput.rates(time.monotonic(), window_s)
    kv = engine.kv_manager
    usage = kv.usage()
    sched = engine.scheduler
    held = sum(r.num_computed_tokens for r in sched.running)
    slots = usage.num_used_blocks * engine.block_size
    per_block = kv_bytes_per_block(engine.model_config, engine.block_size, engine.kv_layout,
                                   num_arrays=engine.executor.driver_worker.kv_groups.num_tensors)
    table_blocks = sum(sum(b != kv.null_block for b in table) for r in sched.running
                       for table in kv.block_tables(r.request_id))
    spec: dict[str, str | int | float] = {}  # EngineStats' spec_* fields; their defaults when speculation is off
    if engine.spec is not None:
        s = engine.spec.stats
        spec = dict(spec_method=s.method, spec_num_draft_tokens=s.num_draft_tokens,
                    spec_num_accepted_tokens=s.num_accepted_tokens, spec_mean_accepted_length=s.mean_accepted_length)
    return EngineStats(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting) + len(sched.waiting_for_kv),  # queued, or receiving their KV blocks
        num_kv_blocks_used=usage.num_used_blocks, num_kv_blocks_total=usage.num_blocks,
        kv_token_slot_utilization=min(held / slots, 1.0) if slots else 0.0,
        output_tokens_per_s=out_tps, total_tokens_per_s=all_tps, num_preemptions=engine.num_preemptions,
        prefix_cache_hit_rate=(sched.num_cached_prompt_tokens / sched.num_prompt_tokens
                               if sched.num_prompt_tokens else 0.0),
        prefix_cache_request_hit_rate=(sched.num_admitted_with_hit / sched.num_admitted
                                       if sched.num_admitted else 0.0),
        num_shared_blocks=usage.num_shared_blocks, num_exclusive_blocks=usage.num_exclusive_blocks,
        kv_bytes_used=usage.num_used_blocks * per_block, kv_bytes_without_sharing=table_blocks * per_block,
        kv_transfer=engine.kv_stats.snapshot(), **spec, **lora_fields(engine.lora), tenants=tenant_rows(sched))


def tenant_rows(sched) -> tuple[TenantStats, ...]:
    """Each tenant's requests running and waiting now, and what the scheduler's policy counted for it."""
    policy = sched.policy
    running: dict[str, int] = {}
    waiting: dict[str, int] = {}
    for r in sched.running:
        running[tenant_of(r)] = running.get(tenant_of(r), 0) + 1
    for r in list(sched.waiting) + list(sched.waiting_for_kv.values()):
        waiting[tenant_of(r)] = waiting.get(tenant_of(r), 0) + 1
    served = getattr(policy, "served", {})
    counters = getattr(policy, "counters", {})
    weight = getattr(policy, "weight", lambda name: 1.0)
    names = sorted(set(running) | set(waiting) | set(policy.tokens) | set(served))
    return tuple(TenantStats(name, running.get(name, 0), waiting.get(name, 0), policy.tokens.get(name, 0),
                             weight(name), served.get(name, 0.0), counters.get(name, 0.0)) for name in names)


def lora_fields(manager) -> dict:
    """EngineStats' lora_* fields (their defaults when LoRA is off)."""
    if manager is None:
        return {}
    s = manager.stats()
    return dict(lora_loaded=s.loaded, lora_resident=s.resident, lora_hits=s.hits, lora_loads=s.loads,
                lora_evictions=s.evictions)


def stats_log_fields(s: EngineStats) -> dict:
    """The periodic engine.stats log line's fields (KV transfer and speculation only when there is something
    to say)."""
    return dict(running=s.num_running, waiting=s.num_waiting, kv_blocks_used=s.num_kv_blocks_used,
                kv_blocks_total=s.num_kv_blocks_total, kv_block_usage=round(s.kv_block_usage, 4),
                kv_token_slot_utilization=round(s.kv_token_slot_utilization, 4),
                output_tokens_per_s=round(s.output_tokens_per_s, 1),
                total_tokens_per_s=round(s.total_tokens_per_s, 1), preemptions=s.num_preemptions,
                **kv_fields(s.kv_transfer), **spec_fields(s))


def kv_fields(k: KVTransferStats | None) -> dict:
    """Disaggregated serving counters, only once there is something to say."""
    if k is None or not (k.kv_blocks_sent or k.kv_blocks_received or k.local_prefill_fallbacks):
        return {}
    return {"kv_blocks_sent": k.kv_blocks_sent, "kv_blocks_received": k.kv_blocks_received,
            "remote_prefills": k.remote_prefills, "local_prefill_fallbacks": k.local_prefill_fallbacks,
            "kv_bytes_sent": k.kv_bytes_sent, "kv_bytes_received": k.kv_bytes_received,
            "kv_transfer_s": round(k.kv_transfer_s, 4)}


def spec_fields(s: EngineStats) -> dict:
    """Speculative decoding figures for engine.stats, only when it is on."""
    if not s.spec_method:
        return {}
    return dict(spec_method=s.spec_method, spec_draft_tokens=s.spec_num_draft_tokens,
                spec_accepted_tokens=s.spec_num_accepted_tokens,
                spec_acceptance_rate=round(s.spec_acceptance_rate, 4),
                spec_mean_accepted_length=round(s.spec_mean_accepted_length, 3))
