"""AsyncEngine: one engine stepping in a worker thread, many async callers on the event loop.

    event loop (anyio/asyncio)                 worker thread
    generate() --make_request (validate)--+
                --("add", request)------->|  commands (locked deque, Event to wake)
    abort()    --("abort", id)----------->|  drain commands -> engine.step() -> outputs
    per-request stream <--call_soon_threadsafe--+

The step loop never runs on the event loop, so RPCs stay responsive while a forward pass runs, and
one engine serves every caller (continuous batching across clients). Validation happens before a
request is queued, so bad input fails at once with a ValueError.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from typing import AsyncIterator, Sequence

import anyio
import structlog

from .engine import LLMEngine
from .executor import WorkerFailedError
from .kv_connector import KVExport
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = structlog.get_logger("pagedserve.engine")


class QueueFullError(Exception):
    """More requests are waiting than max_waiting_requests allows."""


class EngineStoppedError(Exception):
    """The engine is draining or stopped and takes no new requests."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256, stats_interval_s: float = 10.0) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.stats_interval_s = stats_interval_s
        self.accepting = True
        self._streams: dict[str, anyio.abc.ObjectSendStream] = {}
        self._commands: deque[tuple[str, object]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending_adds = 0
        self.started_at = time.monotonic()
        self.failure: BaseException | None = None
        # The worker publishes a stats snapshot; readers on the event loop never touch live engine state.
        self.stats = engine.get_stats()
        self._stats_at = 0.0

    # -- lifecycle --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Step the engine in a worker thread until stop(); returns when the worker has exited."""
        self._loop = asyncio.get_running_loop()
        await anyio.to_thread.run_sync(self._worker, abandon_on_cancel=True)

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._pending_adds

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting, let in-flight requests finish for up to timeout_s, abort the rest.

        Returns how many requests were aborted.
        """
        self.accepting = False
        with anyio.move_on_after(timeout_s):
            while self._streams:
                await anyio.sleep(0.05)
        left = list(self._streams)
        for rid in left:
            self._fail(rid, EngineStoppedError(f"server shutting down: request aborted after the "
                                               f"{timeout_s:g} s drain timeout"))
            self.abort(rid)
        return len(left)

    # -- requests ---------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                       cache_salt: str | None = None, kv_export: KVExport | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step. Leaving early (cancel, break) aborts it."""
        if not self.accepting or self._stop:
            raise EngineStoppedError("server is shutting down and accepts no new requests")
        if self.failure is not None:
            raise EngineStoppedError(f"engine failed: {self.failure!r}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting "
                                 f"(max_waiting_requests={self.max_waiting_requests}); retry later")
        request = self.engine.make_request(request_id, prompt, params, cache_salt=cache_salt)
        request.seqs[0].kv_export = kv_export  # a prefill instance's request: its blocks are sent on
        send, receive = anyio.create_memory_object_stream[object](math.inf)
        self._streams[request_id] = send
        self._submit("add", request)
        finished = False
        try:
            async with receive:
                async for item in receive:
                    if isinstance(item, BaseException):
                        raise item
                    finished = item.finished
                    yield item
                    if finished:
                        return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit("abort", request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a request by id; True if it was in flight. Its blocks are freed before the next step."""
        found = request_id in self._streams
        self._submit("abort", request_id)
        send = self._streams.pop(request_id, None)
        if send is not None:
            send.close()
        return found

    def _submit(self, kind: str, payload: object) -> None:
        with self._lock:
            self._commands.append((kind, payload))
            if kind == "add":
                self._pending_adds += 1
        self._wake.set()

    def _fail(self, request_id: str, error: BaseException) -> None:
        send = self._streams.pop(request_id, None)
        if send is not None:
            send.send_nowait(error)
            send.close()

    # -- the worker thread ------------------------------------------------------------------------

    def _worker(self) -> None:
        last_stats = time.monotonic()
        while not self._stop:
            self._drain_commands()
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except WorkerFailedError as e:  # a rank died: the engine cannot go on; the server exits
                    log.error("engine.workers_failed", error=str(e))
                    self.failure = e
                    self._fail_all_in_flight(e)
                    return
                except Exception as e:  # a bug, not bad input: fail in-flight requests, keep serving
                    log.error("engine.step_failed", error=repr(e))
                    self._abort_all_after_failure(e)
                    continue
                self._post(outputs)
                for rid, error in self.engine.take_failed_requests():  # remote prefill failed, no fallback
                    self._loop.call_soon_threadsafe(self._fail, rid, error)
            else:
                self._snapshot_stats(force=True)
                self._wake.wait(timeout=0.5)
                self._wake.clear()
            self._snapshot_stats()
            now = time.monotonic()
            if now - last_stats >= self.stats_interval_s:
                last_stats = now
                self._log_stats()

    def _snapshot_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._stats_at >= 0.2:
            self.stats = self.engine.get_stats()
            self._stats_at = now

    def _drain_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, deque()
        for kind, payload in commands:
            if kind == "add":
                with self._lock:
                    self._pending_adds -= 1
                if payload.request_id in self._streams:  # not cancelled while queued
                    self.engine.add_prepared(payload)
            else:
                self.engine.abort_request(payload)

    def _post(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            send = self._streams.get(out.request_id)
            if send is None:
                continue  # cancelled meanwhile; the abort command is already queued
            try:
                send.send_nowait(out)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    def _abort_all_after_failure(self, error: Exception) -> None:
        ids = list(self.engine.groups)
        self.engine.abort_request(ids)
        if self._loop is not None:
            for rid in ids:
                self._loop.call_soon_threadsafe(self._fail, rid, RuntimeError(f"engine step failed: {error!r}"))

    def _fail_all_in_flight(self, error: WorkerFailedError) -> None:
        ids = list(self.engine.groups)
        self.engine.abort_request(ids)
        if self._loop is not None:
            fail = EngineStoppedError(f"the engine failed and the server is stopping: {error}")
            for rid in set(ids) | set(self._streams):
                self._loop.call_soon_threadsafe(self._fail, rid, fail)

    def _log_stats(self) -> None:
        s = self.stats
        log.info("engine.stats", running=s.num_running, waiting=s.num_waiting, kv_blocks_used=s.num_kv_blocks_used,
                 kv_blocks_total=s.num_kv_blocks_total, kv_block_usage=round(s.kv_block_usage, 4),
                 kv_token_slot_utilization=round(s.kv_token_slot_utilization, 4),
                 output_tokens_per_s=round(s.output_tokens_per_s, 1),
                 total_tokens_per_s=round(s.total_tokens_per_s, 1), preemptions=s.num_preemptions,
                 **_kv_fields(s.kv_transfer), **_spec_fields(s))


def _kv_fields(k) -> dict:
    """Disaggregated serving counters, only once there is something to say."""
    if k is None or not (k.kv_blocks_sent or k.kv_blocks_received or k.local_prefill_fallbacks):
        return {}
    return {"kv_blocks_sent": k.kv_blocks_sent, "kv_blocks_received": k.kv_blocks_received,
            "remote_prefills": k.remote_prefills, "local_prefill_fallbacks": k.local_prefill_fallbacks,
            "kv_bytes_sent": k.kv_bytes_sent, "kv_bytes_received": k.kv_bytes_received,
            "kv_transfer_s": round(k.kv_transfer_s, 4)}


def _spec_fields(s) -> dict:
    """Speculative decoding figures for engine.stats, only when it is on."""
    if not s.spec_method:
        return {}
    return dict(spec_method=s.spec_method, spec_draft_tokens=s.spec_num_draft_tokens,
                spec_accepted_tokens=s.spec_num_accepted_tokens,
                spec_acceptance_rate=round(s.spec_acceptance_rate, 4),
                spec_mean_accepted_length=round(s.spec_mean_accepted_length, 3))
