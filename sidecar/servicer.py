"""The pagedserve.v1.Generation servicer: protobuf in, AsyncEngine calls, protobuf out.

Status codes: bad input -> INVALID_ARGUMENT (the ValueError's message, which names the field); full
queue -> RESOURCE_EXHAUSTED; loading or draining -> UNAVAILABLE. A cancelled or timed-out RPC leaves
the engine's async generator, which aborts the request and frees its blocks. Generate sends its response
headers (request id, prompt tokens) as soon as the engine admits the request, before any generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

import grpc
import structlog
from google.protobuf.message import Message

from pagedserve.runtime.engine.async_engine import LONG_PROMPT_CHARS, AsyncEngine, EngineStoppedError, QueueFullError
from pagedserve.runtime.engine.tenant_quotas import QuotaExceededError
from pagedserve.runtime.kv_transfer.kv_connector import KVTransferError
from pagedserve.runtime.outputs import RequestOutput
from pagedserve.runtime.sampling_params import SamplingParams
from pagedserve.runtime.structured_output.schema_check import MAX_VIOLATIONS
from pagedserve.runtime.structured_outputs_params import MAX_ERROR_CHARS, MAX_WARNINGS, StructuredOutputsParams

from .client_types import PROMPT_TOKENS_HEADER, REQUEST_ID_HEADER
from .pb import generation_pb2 as pb
from .pb import generation_pb2_grpc as pb_grpc
from .stats_schema import server_stats_message
from .tenant_access import Callers, scoped_id, scoped_salt

if TYPE_CHECKING:
    from .metrics import ServerMetrics

log = structlog.get_logger("pagedserve.server")

_SCALAR_FIELDS = ("n", "best_of", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens", "ignore_eos",
                  "logprobs", "skip_special_tokens", "include_stop_str_in_output")
CHAT_ROLES = ("system", "user", "assistant", "tool")
# OpenAI's newer names for a role the chat templates know by another: the template sees the value.
ROLE_ALIASES = {"developer": "system"}


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    kwargs: dict[str, Any] = {name: getattr(msg, name) for name in _SCALAR_FIELDS if msg.HasField(name)}
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(msg.structured_outputs)
    return SamplingParams(**kwargs)  # ValueError names the field


def structured_outputs_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputsParams:
    kind = msg.WhichOneof("constraint")
    if kind is None:
        raise ValueError("structured_outputs is set but has no constraint: set one of json_schema, regex, "
                         "choice, grammar or json_object")
    strict = msg.strict if msg.HasField("strict") else False
    if kind == "json_schema":
        return StructuredOutputsParams(json=msg.json_schema, strict=strict)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(msg.choice.options), strict=strict)
    if kind == "json_object" and not msg.json_object:
        raise ValueError("structured_outputs.json_object must be true when set")
    return StructuredOutputsParams(**{kind: getattr(msg, kind)}, strict=strict)  # ValueError names the field


async def _off_loop_if_large(request: Message, fn: Callable, *args: Any) -> Any:
    """fn(*args), in a worker thread when the request is large: rendering and tokenizing a long prompt
    takes seconds, which must not stall every other stream on the event loop."""
    if request.ByteSize() > LONG_PROMPT_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class ClientGoneError(Exception):
    """A write found the RPC already ended by the client (cancelled, deadline passed)."""


class AdapterNotFoundError(Exception):
    """A request named a LoRA adapter the server has not loaded (NOT_FOUND)."""


def lora_for(engine: AsyncEngine, name: str):
    """The LoRARequest of adapter `name` ("" -> None, the base); AdapterNotFoundError if unknown, ValueError
    if the server serves no adapters."""
    if not name:
        return None
    if not engine.lora_enabled:
        raise ValueError(f"lora_name {name[:200]!r}: this server serves no LoRA adapters (start it with --enable-lora)")
    lora = engine.lora_request(name)
    if lora is None:
        raise AdapterNotFoundError(f"LoRA adapter {name[:200]!r} not found; loaded: "
                                   f"{', '.join(r.lora_name for r in engine.lora_adapters()) or 'none'}")
    return lora


class SlowReaderError(Exception):
    """The client stopped reading its stream for longer than slow_reader_timeout."""


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, get_engine: Callable[[], AsyncEngine | None], model_name: Callable[[], str],
                 max_prompt_chars: int, max_chat_messages: int = 1024, slow_reader_timeout: float = 30.0,
                 metrics: ServerMetrics | None = None, callers: Callers | None = None) -> None:
        self._get_engine = get_engine
        self.callers = callers or Callers(None)  # who calls (tenant_access.py); no tenants file: nobody in particular
        self.metrics = metrics  # None when --metrics-port is unset
        self.slow_reader_timeout = slow_reader_timeout
        self._model_name = model_name
        self.max_prompt_chars = max_prompt_chars
        self.max_chat_messages = max_chat_messages

    async def _engine(self, context) -> AsyncEngine:
        engine = self._get_engine()
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        return engine

    def _check_text(self, text: str, field: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise ValueError(f"{field} is {len(text)} characters; the limit is {self.max_prompt_chars}")

    def _chat_ids(self, engine: AsyncEngine, chat: pb.ChatMessages) -> list[int]:
        if not chat.messages:
            raise ValueError("chat.messages is empty")
        if len(chat.messages) > self.max_chat_messages:
            raise ValueError(f"chat.messages has {len(chat.messages)} messages; the limit is {self.max_chat_messages}")
        messages = []
        total = 0
        for i, m in enumerate(chat.messages):
            role = ROLE_ALIASES.get(m.role, m.role)
            if role not in CHAT_ROLES:
                raise ValueError(f"chat.messages[{i}].role {m.role[:40]!r} is not one of "
                                 f"{list(CHAT_ROLES) + list(ROLE_ALIASES)}")
            self._check_text(m.content, f"chat.messages[{i}].content")
            total += len(m.content)
            messages.append({"role": role, "content": m.content})
        if total > self.max_prompt_chars:  # the rendered conversation is one prompt
            raise ValueError(f"chat.messages hold {total} characters in all; the limit is {self.max_prompt_chars}")
        add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        return engine.tokenize_chat(messages, add_generation_prompt=add_gen)

    def _prompt(self, engine: AsyncEngine, request: pb.GenerateRequest):
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise ValueError("prompt is missing: set text, token_ids or chat")
        if kind == "text":
            if not request.text:
                raise ValueError("prompt is empty")
            self._check_text(request.text, "text")
            return request.text
        if kind == "token_ids":
            return request.token_ids.ids  # the engine checks its length before copying it
        return self._chat_ids(engine, request.chat)

    async def Generate(self, request: pb.GenerateRequest, context):
        # Messages go out through context.write, each bounded by slow_reader_timeout: a client that stops
        # reading fills its HTTP/2 window, the write blocks, and the request is ended RESOURCE_EXHAUSTED
        # (its blocks freed) instead of holding a running slot and a growing buffer.
        request_id = request.request_id or uuid.uuid4().hex
        tenant = self.callers.tenant(context)
        start = time.monotonic()
        last: RequestOutput | None = None
        outcome = "internal"
        try:
            engine = self._get_engine()
            if engine is None:  # answered UNAVAILABLE below, and counted as every other outcome is
                raise EngineStoppedError("the model is still loading; retry shortly")
            params = sampling_params_from_proto(request.sampling)
            lora = lora_for(engine, request.lora_name)
            prompt = await _off_loop_if_large(request, self._prompt, engine, request)
            whole = (params.best_of or params.n) > params.n  # best_of: only the chosen n, at the end
            outputs = engine.generate(scoped_id(tenant, request_id), prompt, params,
                                      cache_salt=scoped_salt(tenant, request.cache_salt or None),
                                      on_admitted=lambda group: self._send_headers(context, request_id, group),
                                      tenant=tenant, priority=request.priority, lora_request=lora)
            warnings = params.structured_outputs.warnings if params.structured_outputs is not None else []
            async with contextlib.aclosing(outputs):  # leaving early aborts the request at once
                async for out in outputs:
                    last = out
                    for c in out.outputs:
                        if whole or c.new_token_ids:
                            chunk = self._chunk(c, params, whole)
                            if warnings:  # the stream's first chunk
                                chunk.warnings.extend(w[:MAX_ERROR_CHARS] for w in warnings[:MAX_WARNINGS])
                                warnings = []
                            await self._write(context, pb.GenerateResponse(chunk=chunk))
            if last is None or not last.finished:  # aborted through the Abort RPC
                await self._write(context, pb.GenerateResponse(chunk=pb.Chunk(index=0, finish_reason="abort")))
            await self._write(context, pb.GenerateResponse(usage=self._usage(request_id, last, start)))
            outcome = "abort" if last is None or not last.finished else (last.outputs[0].finish_reason or "abort")
        except ValueError as e:
            outcome = "invalid_argument"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QuotaExceededError as e:  # this tenant is over a quota; the hint in seconds, as trailing metadata
            outcome = "resource_exhausted"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                                trailing_metadata=(("retry-after-s", f"{e.retry_after_s:g}"),))
        except AdapterNotFoundError as e:
            outcome = "not_found"
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except (QueueFullError, SlowReaderError) as e:
            outcome = "resource_exhausted"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (EngineStoppedError, KVTransferError) as e:
            outcome = "unavailable"
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except RuntimeError as e:  # this request failed in the engine: a bug, reported as such
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        except asyncio.CancelledError:  # the client cancelled or its deadline passed
            outcome = "cancelled"
            raise
        except ClientGoneError:  # the same, noticed by a write: nobody is left to answer
            outcome = "cancelled"
        except Exception as e:  # a bug while preparing this request: it alone fails
            log.error("request.servicer_error", request_id=request_id[:256], error=repr(e))
            await context.abort(grpc.StatusCode.INTERNAL, f"request failed: {e!r}")
        finally:
            if self.metrics is not None:
                self._observe(outcome, start, last, tenant)

    def _observe(self, outcome: str, start: float, last: RequestOutput | None, tenant: str | None = None) -> None:
        ttft = tpot = None
        prompt_tokens = generated = 0
        if last is not None and last.finished:
            m = last.metrics
            ttft = m.ttft
            prompt_tokens = len(last.prompt_token_ids)
            generated = sum(len(c.token_ids) for c in last.outputs)
            n0 = len(last.outputs[0].token_ids) if last.outputs else 0
            if n0 > 1 and m.first_token_time is not None and m.finished_time is not None:
                tpot = (m.finished_time - m.first_token_time) / (n0 - 1)
        self.metrics.observe_request(outcome, time.monotonic() - start, ttft, tpot, prompt_tokens, generated)
        if tenant is not None:
            self.metrics.observe_tenant(tenant, outcome, prompt_tokens, generated)

    async def _send_headers(self, context, request_id: str, group) -> None:
        """Answer at once, before any generation: the request passed every check and is in the engine.
        The headers carry its id and prompt length, so a client can tell an admitted request that is
        still working (best_of > n sends no message until every sample is done) from a hung server."""
        metadata = ((REQUEST_ID_HEADER, request_id.encode()), (PROMPT_TOKENS_HEADER, str(len(group.prompt_token_ids))))
        try:
            await asyncio.wait_for(context.send_initial_metadata(metadata), self.slow_reader_timeout)
        except asyncio.TimeoutError:
            raise SlowReaderError(f"the client took no headers for {self.slow_reader_timeout:g} s "
                                  f"(slow_reader_timeout); the request was aborted") from None
        except (grpc.aio.InternalError, grpc.aio.UsageError):  # the call already ended (see _write)
            raise ClientGoneError() from None

    async def _write(self, context, message: pb.GenerateResponse) -> None:
        try:
            await asyncio.wait_for(context.write(message), self.slow_reader_timeout)
        except asyncio.TimeoutError:
            raise SlowReaderError(f"the client read nothing for {self.slow_reader_timeout:g} s "
                                  f"(slow_reader_timeout); the request was aborted") from None
        except grpc.aio.InternalError:
            # ExecuteBatchError: the call ended under the write (the client cancelled or its deadline
            # passed while the write was in flight; the handler's own cancellation may come after it).
            # Nobody is left to answer, and it is no fault of the server's.
            raise ClientGoneError() from None

    @staticmethod
    def _chunk(c, params: SamplingParams, whole: bool = False) -> pb.Chunk:
        ids = c.token_ids if whole else c.new_token_ids
        chunk = pb.Chunk(index=c.index, text=c.text if whole else c.new_text, token_ids=ids,
                         finish_reason=c.finish_reason or "",
                         schema_violations=[v[:MAX_ERROR_CHARS] for v in c.schema_violations[:MAX_VIOLATIONS]])
        if params.logprobs is not None and c.logprobs and ids:
            for token_id, entry in zip(ids, c.logprobs[-len(ids):]):
                top = sorted(((t, lp) for t, lp in entry.items() if t != token_id), key=lambda x: -x[1])
                chunk.logprobs.add(token_id=token_id, logprob=entry[token_id],
                                   top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in top])
        if isinstance(c.stop_reason, int):
            chunk.stop_token_id = c.stop_reason
        elif isinstance(c.stop_reason, str):
            chunk.stop_str = c.stop_reason
        return chunk

    @staticmethod
    def _usage(request_id: str, out: RequestOutput | None, start: float) -> pb.Usage:
        usage = pb.Usage(request_id=request_id, e2e_s=time.monotonic() - start)
        if out is not None:
            m = out.metrics
            usage.prompt_tokens = len(out.prompt_token_ids)
            usage.completion_tokens = sum(len(c.token_ids) for c in out.outputs)
            usage.cached_tokens = out.num_cached_tokens
            usage.queue_time_s = m.queue_time or 0.0
            usage.ttft_s = m.ttft or 0.0
        return usage

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        engine = await self._engine(context)
        try:
            ids = await _off_loop_if_large(request, self._tokenize, engine, request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    def _tokenize(self, engine: AsyncEngine, request: pb.TokenizeRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "chat":
            return self._chat_ids(engine, request.chat)
        if kind == "text":
            self._check_text(request.text, "text")
            add = request.add_special_tokens if request.HasField("add_special_tokens") else True
            return engine.tokenize(request.text, add_special_tokens=add)
        raise ValueError("input is missing: set text or chat")

    async def Detokenize(self, request: pb.DetokenizeRequest, context):
        engine = await self._engine(context)
        vocab = engine.vocab_size
        if len(request.token_ids) > self.max_prompt_chars:  # every token is at least a character of text
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token_ids has {len(request.token_ids)} ids; "
                                f"the limit is {self.max_prompt_chars} (max_prompt_chars)")
        bad = [t for t in request.token_ids if not 0 <= t < vocab]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token_ids must be in [0, {vocab}); got {bad[:5]}")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = engine.detokenize(request.token_ids, skip_special_tokens=skip)
        return pb.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request, context):
        engine = await self._engine(context)
        return pb.ModelInfo(name=self._model_name(), **dataclasses.asdict(engine.model_info()))

    async def GetServerStats(self, request, context):
        engine = await self._engine(context)
        # The snapshot, with the KV-transfer counters read now: a decode instance's are bumped before the
        # stream that used them moves on, so a reader never sees them late.
        return server_stats_message(engine.stats, engine.kv_transfer_stats(), time.monotonic() - engine.started_at,
                                    self.callers.tenant(context))

    async def Abort(self, request: pb.AbortRequest, context):
        engine = await self._engine(context)
        # Another tenant's request is out of reach: its scoped id is not this caller's, so found=false.
        return pb.AbortResponse(found=engine.abort(scoped_id(self.callers.tenant(context), request.request_id)))
