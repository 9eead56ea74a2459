"""One way to build an engine on the tiny committed model, drain it with a step bound, and wait on a condition.

- make_engine(loaded=None, **overrides): an LLMEngine on CPU with seed 0 over `loaded` (default: tests/data/tiny-llama,
  loaded once); overrides are EngineConfig fields.
- drain(engine, max_steps=...): step until nothing is unfinished; fails (not hangs) past max_steps; checks the block
  pool's integrity after every step and, at the end, that no KV block is still held (the draft model's pool too).
- wait_until(predicate, timeout_s, what): poll a condition against a deadline; fails with `what` when it never holds.
- InlineConnector(prefill, fault=None): disaggregated prefill in one process (the prefill engine runs in start_load).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from pagedserve.runtime.kv_transfer.kv_connector import KVConnector, KVExport, KVLoadResult
from pagedserve.runtime.sampling_params import SamplingParams

DATA = Path(__file__).parent / "data"

ENGINE_DEFAULTS = dict(device="cpu", max_num_batched_tokens=64, num_kv_blocks=512, seed=0)


@functools.lru_cache(maxsize=None)
def tiny_loaded(name: str = "tiny-llama"):
    """A committed test model (tests/data/<name>), loaded once per process."""
    from pagedserve.models.loading.loader import load_model

    return load_model(DATA / name)


def make_engine(loaded=None, **overrides):
    """An LLMEngine over `loaded` (default: the tiny Llama) with ENGINE_DEFAULTS updated by `overrides`."""
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine

    loaded = tiny_loaded() if loaded is None else loaded
    return LLMEngine(EngineConfig(**{**ENGINE_DEFAULTS, **overrides}), loaded=loaded)


def _pools(engine):
    """(name, KV cache manager) of every pool the engine holds: its own and a draft model's."""
    pools = [("engine", engine.kv_manager)]
    spec = getattr(engine, "spec", None)
    if spec is not None and getattr(spec, "draft", None) is not None:
        pools.append(("draft", spec.draft.kv))
    return pools


def check_integrity(engine) -> None:
    """The block pools' ref counts against the live block tables (raises BlockPoolIntegrityError if off)."""
    for _, kv in _pools(engine):
        kv.check_integrity()


def assert_no_leaks(engine) -> None:
    """Nothing unfinished and every KV block back in its pool's free queue."""
    assert not engine.has_unfinished_requests(), "requests still unfinished"
    for name, kv in _pools(engine):
        usage = kv.usage()
        assert usage.num_used_blocks == 0 and usage.num_free_blocks == usage.num_blocks, \
            f"{usage.num_used_blocks} KV blocks of the {name} pool still held after every request finished"


def drain(engine, max_steps: int = 5_000, *, integrity: bool = True, leaks: bool = True,
          on_step: Callable | None = None) -> dict:
    """Step `engine` until no request is unfinished; returns {request_id: its finished RequestOutput}.

    Fails if more than `max_steps` steps would be needed (a livelocked scheduler fails the test, not CI) or if a
    request finishes twice. With `integrity`, the pools are checked after every step; with `leaks`, at the end no
    block may still be held. on_step(engine, step) runs after each step.
    """
    finished: dict = {}
    for step in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, f"request {out.request_id!r} finished twice"
                finished[out.request_id] = out
        if integrity:
            check_integrity(engine)
        if on_step is not None:
            on_step(engine, step)
    else:
        if engine.has_unfinished_requests():
            pytest.fail(f"the engine still had unfinished requests after {max_steps} steps "
                        f"(running {len(engine.scheduler.running)}): livelock or a too small max_steps")
    if leaks:
        assert_no_leaks(engine)
    return finished


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.005):
    """Poll `predicate` until it returns a truthy value (returned) or `timeout_s` passes (the test fails, naming
    `what`). A bounded wait on a condition: never a fixed sleep standing in for synchronisation."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


class InlineConnector(KVConnector):
    """A KV connector (disaggregated prefill) that runs the prefill engine to completion inside start_load and
    delivers what it exported; `fault`: "down" or "corrupt" instead."""

    transport_name = "inline"

    def __init__(self, prefill, fault: str | None = None) -> None:
        super().__init__()
        self.prefill = prefill
        self.fault = fault
        self.specs = []

    def start_load(self, spec) -> None:
        self.specs.append(spec)
        if self.fault == "down":
            self._deliver(KVLoadResult(spec.request_id, error="UNAVAILABLE: connection refused"))
            return
        wire = self.prefill.kv_transfer_spec("prefill")
        shape = (len(spec.dst_block_ids), *wire.block_shape)

        def sink(io, block_ids):
            out = np.empty(shape, wire.storage)  # the pool's own dtype (bfloat16: uint16 bits)
            io.read_into(block_ids, out)
            return out

        export = KVExport(spec.first_block, sink)
        lora = self.prefill.lora.get(spec.lora_name) if spec.lora_name else None  # the same name there
        group = self.prefill.make_request("p-" + spec.request_id, spec.token_ids,
                                          SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                                          cache_salt=spec.cache_salt, lora_request=lora)
        group.seqs[0].kv_export = export
        self.prefill.add_prepared(group)
        drain(self.prefill, max_steps=100, leaks=False)  # a prompt of at most a few chunks
        if self.fault == "corrupt":
            self._deliver(KVLoadResult(spec.request_id, error="transfer broken: checksum mismatch", broken=True))
            return
        self._deliver(KVLoadResult(spec.request_id, data=export.result, num_bytes=export.result.nbytes))
