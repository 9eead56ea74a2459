"""The memory budget: known at start, refused at start when the host cannot hold it."""

from __future__ import annotations

import pytest

from pagedserve.runtime.worker import memory_budget as budget_mod  # the engine's check at start lives there
from pagedserve.runtime.worker import worker as worker_mod
from pagedserve.runtime.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from pagedserve.runtime.engine.llm_engine import LLMEngine
from pagedserve.runtime.worker.memory_budget import activation_bytes, default_cpu_kv_bytes, host_memory_available, resident_bytes  # noqa: E501
from pagedserve.runtime.worker.worker import Worker


def test_budget_adds_up(tiny):
    e = LLMEngine(EngineConfig(device="cpu", kv_cache_memory_bytes=32 << 20), loaded=tiny)
    b = e.memory_budget
    assert b.kv_cache_bytes == sum(k.nbytes + v.nbytes for k, v in e.executor.driver_worker.kv_caches)
    assert b.weights_bytes == sum(w.nbytes for w in tiny.weights.values())
    assert b.total_bytes == b.held_bytes + b.kv_cache_bytes + b.activation_bytes + b.request_state_bytes
    assert 0 < resident_bytes() and host_memory_available()[0] > 0


def test_activations_grow_with_the_step_budget(tiny):
    cfg = tiny.config
    small = activation_bytes(cfg, 256, 16, 512, 4096)
    big = activation_bytes(cfg, 2048, 16, 512, 4096)
    assert big > small > 0
    # The prefill scores of one chunk against a whole max_model_len context are counted.
    assert activation_bytes(cfg, 2048, 16, 2048, 4096) >= cfg.num_attention_heads * 2048 * 2048 * 4


def test_the_numba_prefill_tiles_of_every_thread_are_counted(tiny):
    """Each CPU thread's tile of scores (TILE_TOKENS query tokens x G heads x max_model_len keys) in the numba
    long-prefill path: with many threads and a small step budget it outgrows the reference's all-heads scores."""
    from pagedserve.cupy_kernels.numba_cpu import prefill as numba_prefill
    from pagedserve.runtime.worker import memory_budget

    assert memory_budget.PREFILL_TILE_TOKENS == numba_prefill.TILE_TOKENS
    assert memory_budget.PREFILL_GROUP_KEYS == numba_prefill.GROUP_KEYS
    cfg = tiny.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    one = activation_bytes(cfg, 32, 16, 4096, 4096, threads=1)
    many = activation_bytes(cfg, 32, 16, 4096, 4096, threads=64)
    assert many - one >= (64 * 16 * group - cfg.num_attention_heads * 32 - 2 * 32) * 4096 * 4
    assert activation_bytes(cfg, 2048, 16, 4096, 4096, threads=2) == activation_bytes(cfg, 2048, 16, 4096, 4096)


def test_settings_beyond_the_host_are_refused_before_the_pool_is_allocated(tiny, monkeypatch):
    monkeypatch.setattr(budget_mod, "host_memory_available", lambda: (100 << 20, "MemAvailable"))
    allocated = []
    monkeypatch.setattr(Worker, "initialize_cache", lambda self, *a: allocated.append(a))
    with pytest.raises(ValueError) as err:
        LLMEngine(EngineConfig(device="cpu", kv_cache_memory_bytes=1 << 30), loaded=tiny)
    msg = str(err.value)
    assert "KV pool 1.00 GiB" in msg and "only 0.10 GiB is available (MemAvailable)" in msg, msg
    assert "lower kv_cache_memory_bytes" in msg and not allocated


def test_default_cpu_pool_is_vllms_4_gib_or_half_of_what_the_host_has():
    assert default_cpu_kv_bytes(None) == DEFAULT_CPU_KV_BYTES == 4 << 30
    assert default_cpu_kv_bytes(64 << 30) == 4 << 30
    assert default_cpu_kv_bytes(3 << 30) == (3 << 30) // 2
    assert default_cpu_kv_bytes((1 << 30) + 12345) == 512 << 20  # whole MiB


@pytest.mark.parametrize("available_mib, expect_gib", [(1 << 16, 4.0), (1024, 0.5)])
def test_engine_default_pool_follows_the_host(tiny, monkeypatch, available_mib, expect_gib):
    """Unset kv_cache_memory_bytes: the pool is 4 GiB on a roomy host and shrinks on a small one instead of
    being refused at start (the start check sees the same host). Only the pool's size is under test."""
    monkeypatch.setattr(worker_mod, "host_memory_available", lambda: (available_mib << 20, "MemAvailable"))
    monkeypatch.setattr(budget_mod, "host_memory_available", lambda: (None, "unknown"))
    monkeypatch.setattr(Worker, "initialize_cache", lambda self, *a: None)
    e = LLMEngine(EngineConfig(device="cpu"), loaded=tiny)
    per_block = e.executor.driver_worker.kv_bytes_per_block()
    assert e.num_kv_blocks == int(expect_gib * (1 << 30)) // per_block
