"""The memory budget: known at start, refused at start when the host cannot hold it."""

from __future__ import annotations

import pytest

from pagedserve.runtime import engine as engine_mod
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.engine import LLMEngine
from pagedserve.runtime.memory_budget import activation_bytes, host_memory_available, resident_bytes
from pagedserve.runtime.worker import Worker


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


def test_settings_beyond_the_host_are_refused_before_the_pool_is_allocated(tiny, monkeypatch):
    monkeypatch.setattr(engine_mod, "host_memory_available", lambda: (100 << 20, "MemAvailable"))
    allocated = []
    monkeypatch.setattr(Worker, "initialize_cache", lambda self, *a: allocated.append(a))
    with pytest.raises(ValueError) as err:
        LLMEngine(EngineConfig(device="cpu", kv_cache_memory_bytes=1 << 30), loaded=tiny)
    msg = str(err.value)
    assert "KV pool 1.00 GiB" in msg and "only 0.10 GiB is available (MemAvailable)" in msg, msg
    assert "lower kv_cache_memory_bytes" in msg and not allocated
