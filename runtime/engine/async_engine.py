"""AsyncEngine: one engine stepping in a worker thread, many async callers on the event loop.

    event loop (anyio/asyncio)                 worker thread
    generate() --make_request (validate)--+
                --("add", request)------->|  commands (locked deque, Event to wake)
    abort()    --("abort", id)----------->|  drain commands -> engine.step() -> outputs
    per-request stream <--call_soon_threadsafe--+

The step loop never runs on the event loop, so RPCs stay responsive while a forward pass runs, and
one engine serves every caller (continuous batching across clients). Validation happens before a
request is queued, so bad input fails at once with a ValueError.

The server reads the engine only through AsyncEngine: requests (generate, abort), the published `stats`
snapshot, and the small read API of EngineView (engine_view.py: tokenizer, model facts, live counters,
shutdown). `self.engine` (the LLMEngine) is for the runtime and its tests, never for sidecar/.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from typing import AsyncIterator, Awaitable, Callable, Sequence

import anyio
import structlog

from .engine_view import EngineView
from .llm_engine import LLMEngine
from .stats import stats_log_fields
from .tenant_quotas import TenantQuotas
from ..executor import WorkerFailedError
from ..kv_transfer.kv_connector import KVExport
from ..lora.request import LoRARequest
from ..outputs import EngineStats, RequestOutput
from ..sampling_params import SamplingParams
from ..core.sequence_group import SequenceGroup

log = structlog.get_logger("pagedserve.engine")


# Text prompts longer than this are tokenized off the event loop (a 1M-character prompt takes seconds).
LONG_PROMPT_CHARS = 16_384


class QueueFullError(Exception):
    """More requests are waiting than max_waiting_requests allows."""


class EngineStoppedError(Exception):
    """The engine is draining or stopped and takes no new requests."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (a bug); the others carry on."""


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output standing for two consecutive ones of a request: the newer's cumulative fields, both
    deltas joined. A reader that falls behind gets one merged output instead of a growing queue."""
    older_by_index = {c.index: c for c in older.outputs}
    merged = []
    for c in newer.outputs:
        o = older_by_index.pop(c.index, None)
        if o is not None:
            c = dataclasses.replace(c, new_text=o.new_text + c.new_text,
                                    new_token_ids=o.new_token_ids + c.new_token_ids)
        merged.append(c)
    return dataclasses.replace(newer, outputs=sorted([*older_by_index.values(), *merged], key=lambda c: c.index))


class AsyncEngine(EngineView):
    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256, stats_interval_s: float = 10.0,
                 stream_buffer_size: int = 64) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        if stream_buffer_size < 1:
            raise ValueError(f"stream_buffer_size must be >= 1, got {stream_buffer_size}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        # Each request's outputs wait for its reader in a buffer of this many; beyond it they are merged
        # into one (merge_outputs), so a reader that stops costs O(its request), never O(steps x request).
        self.stream_buffer_size = stream_buffer_size
        self._overflow: dict[str, RequestOutput] = {}
        self._errors: dict[str, BaseException] = {}  # failures that found the stream's buffer full
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
        self.stats: EngineStats = engine.get_stats()
        self._stats_at = 0.0
        self.quotas: TenantQuotas | None = None  # per-tenant quotas (tenant_quotas.py), set by the server

    # -- lifecycle --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Step the engine in a worker thread until stop(); returns when the worker has exited.

        If the worker itself dies (an error outside any one request's processing), `failure` is set,
        every stream in flight ends with EngineStoppedError and new requests are refused; the server
        then goes NOT_SERVING and exits non-zero for systemd to restart it (as when a rank dies)."""
        self._loop = asyncio.get_running_loop()
        await anyio.to_thread.run_sync(self._guarded_worker, abandon_on_cancel=True)

    def _guarded_worker(self) -> None:
        try:
            self._worker()
        except BaseException as e:
            if self._stop:  # shutting down: the event loop may already be closed, and nobody is waiting
                return
            self.failure = e
            log.critical("engine.worker_died", error=repr(e))
            if self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self._fail_all, EngineStoppedError(f"engine worker died: {e!r}"))
                except RuntimeError:  # the loop is gone too
                    pass

    def _fail_all(self, error: BaseException) -> None:
        for rid in list(self._streams):
            self._fail(rid, error)

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
                       cache_salt: str | None = None, kv_export: KVExport | None = None,
                       on_admitted: Callable[[SequenceGroup], Awaitable[None]] | None = None,
                       tenant: str | None = None, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step. Leaving early (cancel, break) aborts it.

        on_admitted(group) is awaited once the request passed every check and was handed to the engine,
        before any output: the server answers a client at once (gRPC headers) even when its first output
        is far off (best_of > n sends nothing until every sample is done). If it raises, the request is
        aborted like any reader that leaves early."""
        if not self.accepting or self._stop:
            raise EngineStoppedError("server is shutting down and accepts no new requests")
        if self.failure is not None:
            raise EngineStoppedError(f"engine failed: {self.failure!r}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting "
                                 f"(max_waiting_requests={self.max_waiting_requests}); retry later")
        quotas, started, last = (self.quotas if tenant is not None else None), False, None
        if quotas is not None:
            quotas.admit(tenant)  # QuotaExceededError: over one of its quotas
        send, receive = anyio.create_memory_object_stream[object](self.stream_buffer_size)
        self._streams[request_id] = send  # the id is taken from here on, while the prompt is tokenized
        try:
            if isinstance(prompt, str) and len(prompt) > LONG_PROMPT_CHARS:
                # Seconds of tokenizing: in a thread, with the GIL released (Tokenizer.encode), so the
                # event loop keeps serving every other stream meanwhile.
                request = await anyio.to_thread.run_sync(
                    lambda: self.engine.make_request(request_id, prompt, params, cache_salt=cache_salt,
                                                     tenant=tenant, priority=priority, lora_request=lora_request))
            else:
                request = self.engine.make_request(request_id, prompt, params, cache_salt=cache_salt,
                                                   tenant=tenant, priority=priority, lora_request=lora_request)
            if request.grammar is not None:  # compiled off the loop; a grammar the tokenizer refuses is bad input
                await asyncio.shield(asyncio.wrap_future(request.grammar))  # shield: the Future is shared
        except BaseException:
            if self._streams.get(request_id) is send:
                del self._streams[request_id]
            send.close()
            receive.close()
            if quotas is not None:
                quotas.release(tenant, False, 0)
            raise
        request.seqs[0].kv_export = kv_export  # a prefill instance's request: its blocks are sent on
        self._submit("add", request)
        finished = False
        try:
            async with receive:
                if on_admitted is not None:
                    await on_admitted(request)
                async for item in receive:
                    if isinstance(item, BaseException):
                        raise item
                    self._flush_overflow(request_id, send)
                    finished = item.finished
                    if quotas is not None and not started:
                        started = True
                        quotas.started(tenant)
                    last = item
                    yield item
                    if finished:
                        return
            if request_id in self._errors:
                raise self._errors.pop(request_id)
        finally:
            self._streams.pop(request_id, None)
            self._overflow.pop(request_id, None)
            self._errors.pop(request_id, None)
            if not finished:
                self._submit("abort", request_id)
            if quotas is not None:
                used = len(last.prompt_token_ids) + sum(len(c.token_ids) for c in last.outputs) if last else 0
                quotas.release(tenant, started, used)

    def _flush_overflow(self, request_id: str, send: anyio.abc.ObjectSendStream) -> None:
        """The reader took an output: move the merged overflow into the room it made."""
        pending = self._overflow.pop(request_id, None)
        if pending is not None:
            try:
                send.send_nowait(pending)
            except anyio.WouldBlock:
                self._overflow[request_id] = pending
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

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
        self._overflow.pop(request_id, None)
        if send is not None:
            try:
                send.send_nowait(error)
            except anyio.WouldBlock:  # the reader is behind: it gets the error after what is buffered
                self._errors[request_id] = error
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
                    try:
                        self.engine.add_prepared(payload)
                    except ValueError as e:
                        # The id is still held in the engine by an earlier request of the same id whose
                        # stream has already ended (fuzzing with reused ids finds this): a duplicate id.
                        if self._loop is not None:
                            self._loop.call_soon_threadsafe(self._fail, payload.request_id, e)
                    except Exception as e:  # this request alone fails
                        if self.engine.groups.get(payload.request_id) is payload:
                            self.engine.abort_request(payload.request_id)
                        log.error("request.failed", request_id=payload.request_id, stage="queue", error=repr(e))
                        if self._loop is not None:
                            error = RequestFailedError(f"request failed while queueing it: {e!r}")
                            self._loop.call_soon_threadsafe(self._fail, payload.request_id, error)
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
            if out.error is not None:  # failed inside the engine; its blocks are already freed
                self._fail(out.request_id, RequestFailedError(out.error))
                continue
            if out.request_id in self._overflow:
                self._overflow[out.request_id] = merge_outputs(self._overflow[out.request_id], out)
                continue
            try:
                send.send_nowait(out)
            except anyio.WouldBlock:
                self._overflow[out.request_id] = out
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
        log.info("engine.stats", **stats_log_fields(self.stats))
