"""Generation over HTTP: a completions or chat request becomes SamplingParams (as a gRPC one does) and one engine
request per prompt; their outputs come back whole or as server-sent events (framed by sse-starlette), rendered
by http_render.py. Every prompt's first output is awaited before any header, so a refusal (bad input, a full
queue) gets its status; a client that disconnects, streaming or not, leaves the engine's generators, which
abort their requests and free their blocks. Each engine request's outcome goes to the Prometheus metrics under
the gRPC path's names.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
import structlog
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError

from pagedserve.runtime.engine.async_engine import LONG_PROMPT_CHARS, AsyncEngine
from pagedserve.runtime.outputs import RequestOutput
from pagedserve.runtime.sampling_params import SamplingParams
from pagedserve.runtime.structured_outputs_params import StructuredOutputsParams

from .http_errors import error_for
from .http_inputs import Inputs, check_unicode, maybe_off_loop
from .http_metrics import OUTCOMES_KEY
from .http_models import ApiError, ChatCompletionRequest, CompletionRequest
from .http_lora import lora_for_model
from .tenant_access import scoped_id, scoped_salt
from .http_outputs import Outputs
from .http_render import ChatRender, CompletionRender, Render, RenderOptions
from .tool_calls import plan_tools

if TYPE_CHECKING:
    from .metrics import ServerMetrics

log = structlog.get_logger("pagedserve.http")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class _EventStream(EventSourceResponse):
    """sse-starlette's response, with a client that read nothing for send_timeout seconds logged as one line
    (its stream ended, its requests aborted by closing the body iterator) instead of an ASGI traceback."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except Exception as e:
            if not _only(e, SendTimeoutError):
                raise
            log.info("http.slow_reader", send_timeout_s=self.send_timeout, detail="stream ended, requests aborted")


def _only(e: BaseException, kind: type) -> bool:
    """e is a `kind`, or an exception group holding nothing else."""
    inner = getattr(e, "exceptions", None)
    return isinstance(e, kind) or (inner is not None and all(_only(x, kind) for x in inner))


class Generation:
    def __init__(self, inputs: Inputs, model_name: Callable[[], str], metrics: ServerMetrics | None,
                 slow_reader_timeout: float | None = None) -> None:
        self.inputs, self._model_name, self.server_metrics = inputs, model_name, metrics
        # A stream whose client reads nothing for this long is ended and its requests aborted (gRPC's
        # slow_reader_timeout): it would otherwise hold its running slot and blocks while it stalls.
        self.slow_reader_timeout = slow_reader_timeout
        self._token_texts: dict[int, str] = {}

    async def completions(self, engine: AsyncEngine, body: CompletionRequest, request: Request):
        prompts = self.inputs.completion_prompts(body.prompt, engine)
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs needs the prompt's logprobs, which this server does not "
                           "compute", "echo", "unsupported")
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else _echo_text(engine, p, "prompt" if len(prompts) == 1 else
                                                            f"prompt[{i}]") for i, p in enumerate(prompts)]
        opts = RenderOptions(n=body.n, num_prompts=len(prompts), return_token_ids=body.return_token_ids,
                             logprobs=body.logprobs, token_text=self._token_text(engine), echo=echo)
        render = CompletionRender(f"cmpl-{uuid.uuid4().hex}", body.model or self._model_name(), opts)
        return await self._generate(request, engine, body, prompts, body.max_tokens, render)

    async def chat_completions(self, engine: AsyncEngine, body: ChatCompletionRequest, request: Request):
        args = (*body.tools_raw(), body.parallel_tool_calls)
        try:  # compiling new tools takes up to ~0.25 s (128 of them): off the loop, not to stall the streams
            plan = await asyncio.to_thread(plan_tools, *args) if args[0] else plan_tools(*args)
        except ValueError as e:
            raise _error(e, body) from None
        constrained = body.structured_outputs is not None or (body.response_format is not None
                                                                and body.response_format.type != "text")
        if plan.forces_calls and constrained:
            raise ApiError(400, f"tool_choice {body.tool_choice if isinstance(body.tool_choice, str) else 'function'}"
                           f" constrains the reply to tool calls; it cannot be combined with response_format or "
                           f"structured_outputs", "tool_choice", "invalid_value")
        messages = self.inputs.chat_messages(body.messages)
        try:
            ids = await maybe_off_loop(sum(len(m["content"] or "") for m in messages), engine.tokenize_chat,
                                       messages, body.add_generation_prompt, plan.template_tools)
        except ValueError as e:
            raise _error(e, body) from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        opts = RenderOptions(n=body.n, return_token_ids=body.return_token_ids,
                             logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                             token_text=self._token_text(engine), tool_plan=plan if plan.mode != "none" else None,
                             warnings=list(plan.warnings))
        render = ChatRender(f"chatcmpl-{uuid.uuid4().hex}", body.model or self._model_name(), opts)
        # auto: the lazy tool-call grammar, unless the request brings its own constraint (which then wins)
        so = None if constrained else plan.structured_outputs
        return await self._generate(request, engine, body, [ids], limit, render, so)

    def _token_text(self, engine: AsyncEngine) -> Callable[[int], str]:
        texts = self._token_texts  # the vocabulary, decoded once per token id as logprobs need it

        def text(token_id: int) -> str:
            s = texts.get(token_id)
            if s is None:
                s = texts[token_id] = engine.detokenize([token_id], skip_special_tokens=False)
            return s
        return text

    def _params(self, engine: AsyncEngine, body, prompts: list, max_tokens: int | None,
                so: StructuredOutputsParams | None = None) -> list[SamplingParams]:
        """One SamplingParams per prompt (they differ only in max_tokens when it is unset); ValueError or
        ApiError naming the field."""
        for i, stop in enumerate([body.stop] if isinstance(body.stop, str) else body.stop or []):
            check_unicode(stop, f"stop[{i}]")
        kwargs = body.sampling_kwargs()
        if body.stream and (kwargs.get("best_of") or body.n) > body.n:
            raise ApiError(400, "best_of > n cannot stream (only the best n are known, at the end)", "best_of",
                           "invalid_value")
        so = so or structured_outputs(body)
        if so is not None:
            kwargs["structured_outputs"] = so
        context = engine.model_info().max_model_len
        params = []
        for i, p in enumerate(prompts):
            if max_tokens is None:  # the rest of the context, as vLLM does; a text prompt is tokenized once, here
                if isinstance(p, str):
                    p = prompts[i] = engine.tokenize(p)  # a long one was, off the loop, by _generate
                params.append(SamplingParams(max_tokens=max(1, context - len(p)), **kwargs))
            else:
                params.append(SamplingParams(max_tokens=max_tokens, **kwargs))
        return params

    async def _generate(self, request: Request, engine: AsyncEngine, body, prompts: list, max_tokens: int | None,
                        render: Render, so: StructuredOutputsParams | None = None):
        try:
            if max_tokens is None:  # long text prompts are tokenized off the loop before _params counts them
                for i, p in enumerate(prompts):
                    if isinstance(p, str) and len(p) > LONG_PROMPT_CHARS:
                        prompts[i] = await asyncio.to_thread(engine.tokenize, p)
            params = self._params(engine, body, prompts, max_tokens, so)
        except ValueError as e:
            raise _error(e, body) from None
        ids = [render.request_id if len(prompts) == 1 else f"{render.request_id}-{i}" for i in range(len(prompts))]
        tenant = request.scope.get("state", {}).get("tenant")  # with a tenants file (http_tenants.py)
        lora = lora_for_model(engine, body.model, self._model_name()) if engine.lora_enabled else None
        outputs = Outputs([engine.generate(scoped_id(tenant, rid), p, sp, cache_salt=scoped_salt(tenant, None),
                                           tenant=tenant, priority=body.priority, lora_request=lora)
                           for rid, p, sp in zip(ids, prompts, params)])
        outputs.tenant = tenant
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        start = time.monotonic()
        try:  # every prompt's first output before any header: refusals (bad input, full queue) get their status
            await self._until_disconnect(request, outputs.prime, body)
            last = await self._until_disconnect(request, outputs.collect, body) if not body.stream else None
        except BaseException as e:
            await outputs.aclose()
            self._observe(request, outputs, start, e)
            raise
        if not body.stream:
            await outputs.aclose()
            self._observe(request, outputs, start)
            return JSONResponse(render.whole(last))
        return _EventStream(self._events(outputs, render, include_usage, lambda e: self._observe(
            request, outputs, start, e)), sep="\n", headers={"Cache-Control": "no-cache"}, ping=15,
            send_timeout=self.slow_reader_timeout)

    def _observe(self, request: Request, outputs: Outputs, start: float, error: BaseException | None = None) -> None:
        """Each engine request's figures in the metrics, and its outcome (named as the gRPC path names them) for
        http_metrics.py's middleware to count once the answer is over."""
        if self.server_metrics is None:
            return
        recorded = request.scope.get(OUTCOMES_KEY)
        failed = None
        if isinstance(error, (ClientGone, asyncio.CancelledError, GeneratorExit)):
            failed = "cancelled"  # the client left
        elif error is not None:
            status = error.status if isinstance(error, ApiError) else None
            failed = {400: "invalid_argument", 429: "resource_exhausted", 503: "unavailable"}.get(status, "internal")
        for last in outputs.last:
            if failed is not None:
                outcome = failed
            elif last is not None and last.finished and last.outputs:
                outcome = last.outputs[0].finish_reason or "abort"
            else:
                outcome = "abort"  # ended without a final output: the gRPC Abort RPC
            self.server_metrics.observe_timings(time.monotonic() - start, *request_timings(last))
            if recorded is not None:
                recorded.append(outcome)
            else:  # an app without the middleware (tests build one): counted at once
                self.server_metrics.count_request("http", outcome)
            if outputs.tenant is not None:
                self.server_metrics.observe_tenant(outputs.tenant, outcome, *request_timings(last)[2:])

    @staticmethod
    async def _until_disconnect(request: Request, fn: Callable[[], Any], body) -> Any:
        """await fn(), cancelled if the client disconnects first (then ClientGone, answered by nobody)."""
        result: list[Any] = []
        errors: list[BaseException] = []

        async def listen() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(listen)
            try:
                result.append(await fn())
            except Exception as e:
                errors.append(e)
            tg.cancel_scope.cancel()
        if errors:
            raise _error(errors[0], body) from None
        if not result:
            raise ClientGone()
        return result[0]

    @staticmethod
    async def _events(outputs: Outputs, render: Render, include_usage: bool,
                      observe: Callable[[BaseException | None], None]) -> AsyncIterator[str]:
        """The stream's events (sse-starlette frames each as "data: ..."); a disconnect cancels this generator,
        and closing `outputs` aborts the requests."""
        def dump(obj: dict) -> str:
            return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))

        error: BaseException | None = None
        try:
            for event in render.start():
                yield dump(event)
            try:
                async for p, out in outputs:
                    for event in render.deltas(p, out):
                        yield dump(event)
            except Exception as e:  # after the headers went out: the error is the stream's last event
                error = error_for(e)
                yield dump(error.body())
                return
            for event in render.unfinished():  # aborted (the gRPC Abort RPC) without a final output
                yield dump(event)
            if include_usage:
                yield dump(render.usage_chunk(outputs.last))
            yield "[DONE]"
        except BaseException as e:  # cancelled: the client left
            error = e
            raise
        finally:
            await outputs.aclose()
            observe(error)



def request_timings(last: RequestOutput | None) -> tuple[float | None, float | None, int, int]:
    """(ttft, tpot of sample 0, prompt tokens, generated tokens) of a finished request, as the gRPC path counts."""
    if last is None or not last.finished:
        return None, None, 0, 0
    m = last.metrics
    n0 = len(last.outputs[0].token_ids) if last.outputs else 0
    tpot = None
    if n0 > 1 and m.first_token_time is not None and m.finished_time is not None:
        tpot = (m.finished_time - m.first_token_time) / (n0 - 1)
    return m.ttft, tpot, len(last.prompt_token_ids), sum(len(c.token_ids) for c in last.outputs)


def _echo_text(engine: AsyncEngine, ids: list[int], field: str) -> str:
    """A token prompt's text for echo; ids the tokenizer cannot decode are refused naming the prompt."""
    try:
        return engine.detokenize(ids, skip_special_tokens=False)
    except ValueError as e:
        raise ApiError(400, f"{field}: {e}", field, "invalid_value") from None


def _error(e: BaseException, body) -> ApiError:
    """error_for, with `param` the body's own name for what the engine's message names."""
    err = error_for(e, set(type(body).model_fields))
    if err.param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        err.param = "max_completion_tokens"
    if isinstance(body, ChatCompletionRequest):
        if err.param == "logprobs":  # chat's count is top_logprobs
            err.param = "top_logprobs"
        if err.param is None and err.status == 400 and err.message.startswith("prompt "):  # the rendered messages
            err.param = "messages"
    return err


def structured_outputs(body) -> StructuredOutputsParams | None:
    """response_format (OpenAI) or structured_outputs (vLLM's extra) as runtime's StructuredOutputsParams;
    ValueError or ApiError naming the field."""
    rf = body.response_format if body.response_format is not None and body.response_format.type != "text" else None
    if rf is not None and body.structured_outputs is not None:
        raise ApiError(400, "set response_format or structured_outputs, not both", "structured_outputs",
                       "invalid_value")
    if body.structured_outputs is not None:
        return StructuredOutputsParams(**body.structured_outputs.params_kwargs())
    if rf is None:
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    try:
        return StructuredOutputsParams(json=rf.json_schema.schema_, strict=bool(rf.json_schema.strict))
    except ValueError as e:
        message = str(e).replace("structured_outputs.json", "response_format.json_schema.schema", 1)
        raise ApiError(400, message, "response_format.json_schema.schema", "invalid_value") from None


