"""The OpenAI-compatible HTTP API: a FastAPI app on the gRPC server's AsyncEngine and event loop.

    POST /v1/completions, POST /v1/chat/completions   (streaming as server-sent events, or whole)
    GET  /v1/models, GET /v1/models/{name}, GET /health (200 only while SERVING)
    GET  /metrics                                      (the Prometheus registry of --metrics-port)
    POST /tokenize, POST /detokenize                   (vLLM's shapes)

A request becomes SamplingParams exactly as a gRPC one does, under the same limits (max_prompt_chars,
max_chat_messages, the queue's max_waiting_requests, the body size gRPC accepts). Errors come in OpenAI's
shape (http_errors.py: 400 naming the field, 401, 404, 413, 429, 503). A client that disconnects, whether
streaming or waiting for a whole answer, leaves the engine's generators, which abort their requests and
free their blocks. Server-sent events are framed by sse-starlette. uvicorn serves it (http_server.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.runtime.engine.async_engine import LONG_PROMPT_CHARS, AsyncEngine
from pagedserve.runtime.outputs import RequestOutput
from pagedserve.runtime.sampling_params import SamplingParams
from pagedserve.runtime.structured_outputs_params import StructuredOutputsParams

from .http_errors import ApiKeyMiddleware, BodyLimitMiddleware, error_for, http_error, invalid_body
from .http_models import ApiError, ChatCompletionRequest, ChatMessage, CompletionRequest
from .http_outputs import Outputs
from .http_render import ChatRender, CompletionRender, Render, RenderOptions
from .http_server import HttpServer
from .servicer import CHAT_ROLES
from .tool_calls import plan_tools

if TYPE_CHECKING:
    from .metrics import ServerMetrics

__all__ = ["HttpApi", "HttpServer"]


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: {model, prompt} or {model, messages}."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


class HttpApi:
    def __init__(self, get_engine: Callable[[], AsyncEngine | None], model_name: Callable[[], str],
                 serving: Callable[[], bool], max_prompt_chars: int, max_chat_messages: int,
                 metrics: ServerMetrics | None = None) -> None:
        self._get_engine, self._model_name, self._serving = get_engine, model_name, serving
        self.max_prompt_chars, self.max_chat_messages = max_prompt_chars, max_chat_messages
        self.server_metrics = metrics  # the registry of --metrics-port (the server makes one with --http-port)
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}

    def app(self, api_key: str | None = None):
        from .server import max_receive_bytes  # the gRPC path's cap on a request's bytes

        app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(ApiError, lambda _r, e: JSONResponse(e.body(), e.status))
        app.add_exception_handler(ClientGone, lambda _r, _e: Response(status_code=499))  # nobody reads it
        app.add_exception_handler(RequestValidationError, invalid_body)
        app.add_exception_handler(StarletteHTTPException, http_error)
        app.add_exception_handler(Exception, _answer_error)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics_text, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{name:path}", self.model, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        wrapped = ApiKeyMiddleware(app, api_key) if api_key else app
        return BodyLimitMiddleware(wrapped, max_receive_bytes(self.max_prompt_chars))

    # -- plain routes -----------------------------------------------------------------------------

    def _engine(self) -> AsyncEngine:
        engine = self._get_engine()
        if engine is None:
            raise ApiError(503, "the model is still loading; retry shortly", None, "loading")
        if not self._serving():
            raise ApiError(503, "the server is shutting down and accepts no new requests", None, "draining")
        return engine

    async def health(self) -> JSONResponse:
        if self._get_engine() is None or not self._serving():
            raise ApiError(503, "not serving (loading or shutting down)", None, "not_serving")
        return JSONResponse({"status": "ok"})

    async def metrics_text(self) -> Response:
        if self.server_metrics is None:
            raise ApiError(404, "metrics are off", None, "not_found")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(self.server_metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _card(self, engine: AsyncEngine) -> dict:
        return {"id": self._model_name(), "object": "model", "created": self.created, "owned_by": "pagedserve",
                "root": self._model_name(), "max_model_len": engine.model_info().max_model_len}

    async def models(self) -> dict:
        return {"object": "list", "data": [self._card(self._engine())]}

    async def model(self, name: str) -> dict:
        engine = self._engine()
        self._check_model(name)
        return self._card(engine)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self._model_name():
            raise ApiError(404, f"model {name[:200]!r} does not exist; this server serves "
                           f"{self._model_name()!r}", "model", "model_not_found")

    async def tokenize(self, body: TokenizeRequest) -> dict:
        engine = self._engine()
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "set one of prompt or messages", "prompt", "invalid_value")
        if body.messages is not None:
            messages = self._chat_messages(body.messages)
            ids = await _maybe_off_loop(sum(len(m["content"] or "") for m in messages), engine.tokenize_chat,
                                        messages, body.add_generation_prompt)
        else:
            self._check_text(body.prompt, "prompt")
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await _maybe_off_loop(len(body.prompt), engine.tokenize, body.prompt, add)
        return {"count": len(ids), "max_model_len": engine.model_info().max_model_len, "tokens": ids}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        engine = self._engine()
        self._check_model(body.model)
        if len(body.tokens) > self.max_prompt_chars:  # every token is at least a character of text
            raise ApiError(400, f"tokens has {len(body.tokens)} ids; the limit is {self.max_prompt_chars} "
                           f"(max_prompt_chars)", "tokens", "invalid_value")
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise ApiError(400, f"tokens must be in [0, {engine.vocab_size}); got {bad[:5]}", "tokens",
                           "invalid_value")
        return {"prompt": engine.detokenize(body.tokens)}

    # -- generation -------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        engine = self._prepare(body)
        prompts = self._completion_prompts(body.prompt, engine)
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs needs the prompt's logprobs, which this server does not "
                           "compute", "echo", "unsupported")
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else engine.detokenize(p, skip_special_tokens=False) for p in prompts]
        opts = RenderOptions(n=body.n, num_prompts=len(prompts), return_token_ids=body.return_token_ids,
                             logprobs=body.logprobs, token_text=self._token_text(engine), echo=echo)
        render = CompletionRender(f"cmpl-{uuid.uuid4().hex}", self._model_name(), opts)
        return await self._generate(request, engine, body, prompts, body.max_tokens, render)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        engine = self._prepare(body)
        try:
            plan = plan_tools(*body.tools_raw(), body.parallel_tool_calls)
        except ValueError as e:
            raise _error(e, body) from None
        constrained = body.structured_outputs is not None or (body.response_format is not None
                                                                and body.response_format.type != "text")
        if plan.structured_outputs is not None and constrained:
            raise ApiError(400, f"tool_choice {body.tool_choice if isinstance(body.tool_choice, str) else 'function'}"
                           f" constrains the reply to tool calls; it cannot be combined with response_format or "
                           f"structured_outputs", "tool_choice", "invalid_value")
        messages = self._chat_messages(body.messages)
        try:
            ids = await _maybe_off_loop(sum(len(m["content"] or "") for m in messages), engine.tokenize_chat,
                                        messages, body.add_generation_prompt, plan.template_tools)
        except ValueError as e:
            raise _error(e, body) from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        opts = RenderOptions(n=body.n, return_token_ids=body.return_token_ids,
                             logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                             token_text=self._token_text(engine), tool_plan=plan if plan.mode != "none" else None,
                             warnings=list(plan.warnings))
        render = ChatRender(f"chatcmpl-{uuid.uuid4().hex}", self._model_name(), opts)
        return await self._generate(request, engine, body, [ids], limit, render, plan.structured_outputs)

    def _prepare(self, body) -> AsyncEngine:
        engine = self._engine()
        self._check_model(body.model)
        if (name := body.unsupported()) is not None:
            raise ApiError(400, f"{name} is not supported by this server's HTTP API", name, "unsupported")
        body.check()
        return engine

    def _token_text(self, engine: AsyncEngine) -> Callable[[int], str]:
        texts = self._token_texts  # the vocabulary, decoded once per token id as logprobs need it

        def text(token_id: int) -> str:
            s = texts.get(token_id)
            if s is None:
                s = texts[token_id] = engine.detokenize([token_id], skip_special_tokens=False)
            return s
        return text

    def _check_text(self, text: str, field: str) -> None:
        _check_unicode(text, field)
        if len(text) > self.max_prompt_chars:
            raise ApiError(400, f"{field} is {len(text)} characters; the limit is {self.max_prompt_chars}",
                           field, "invalid_value")

    def _completion_prompts(self, prompt, engine: AsyncEngine) -> list[str | list[int]]:
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        if len(prompts) > engine.max_waiting_requests:
            raise ApiError(400, f"prompt holds {len(prompts)} prompts; the limit is {engine.max_waiting_requests} "
                           f"(max_waiting_requests)", "prompt", "invalid_value")
        for i, p in enumerate(prompts):
            field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not p:
                raise ApiError(400, f"{field} is empty", field, "invalid_value")
            if isinstance(p, str):
                self._check_text(p, field)
        return prompts  # token ids: the engine checks their range and length before copying them

    def _chat_messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """The conversation for the chat template: role and content, and the tool turns' fields (an assistant's
        tool_calls, a tool result's tool_call_id and name), which the template renders."""
        if len(messages) > self.max_chat_messages:
            raise ApiError(400, f"messages has {len(messages)} messages; the limit is {self.max_chat_messages}",
                           "messages", "invalid_value")
        out, total = [], 0
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise ApiError(400, f"messages[{i}].role {m.role[:40]!r} is not one of {list(CHAT_ROLES)}",
                               f"messages[{i}].role", "invalid_value")
            text = m.text()
            self._check_text(text, f"messages[{i}].content")
            total += len(text)
            message: dict[str, Any] = {"role": m.role, "content": text}
            if m.tool_calls:
                calls = [c.model_dump() for c in m.tool_calls]
                for j, c in enumerate(calls):
                    self._check_text(c["function"]["arguments"], f"messages[{i}].tool_calls[{j}].function.arguments")
                    total += len(c["function"]["arguments"])
                message["tool_calls"] = calls
                if m.content is None:
                    message["content"] = None
            for key in ("tool_call_id", "name"):
                if getattr(m, key) is not None:
                    message[key] = getattr(m, key)
            out.append(message)
        if total > self.max_prompt_chars:  # the rendered conversation is one prompt
            raise ApiError(400, f"messages hold {total} characters in all; the limit is {self.max_prompt_chars}",
                           "messages", "invalid_value")
        return out

    def _params(self, engine: AsyncEngine, body, prompts: list, max_tokens: int | None,
                so: StructuredOutputsParams | None = None) -> list[SamplingParams]:
        """One SamplingParams per prompt (they differ only in max_tokens when it is unset); ValueError or
        ApiError naming the field."""
        for i, stop in enumerate([body.stop] if isinstance(body.stop, str) else body.stop or []):
            _check_unicode(stop, f"stop[{i}]")
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
        outputs = Outputs([engine.generate(rid, p, sp) for rid, p, sp in zip(ids, prompts, params)])
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        start = time.monotonic()
        try:  # every prompt's first output before any header: refusals (bad input, full queue) get their status
            await self._until_disconnect(request, outputs.prime, body)
            last = await self._until_disconnect(request, outputs.collect, body) if not body.stream else None
        except BaseException as e:
            await outputs.aclose()
            self._observe(outputs, start, e)
            raise
        if not body.stream:
            await outputs.aclose()
            self._observe(outputs, start)
            return JSONResponse(render.whole(last))
        return EventSourceResponse(self._events(outputs, render, include_usage, lambda e: self._observe(
            outputs, start, e)), sep="\n", headers={"Cache-Control": "no-cache"}, ping=15)

    def _observe(self, outputs: Outputs, start: float, error: BaseException | None = None) -> None:
        """Each engine request's outcome in the metrics, named as the gRPC path names them."""
        if self.server_metrics is None:
            return
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
            self.server_metrics.observe_request(outcome, time.monotonic() - start, *request_timings(last))

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


async def _answer_error(_request: Request, e: Exception) -> JSONResponse:
    err = error_for(e)  # a ValueError from a route's own checks is still a 400; anything else a logged 500
    return JSONResponse(err.body(), err.status)


def _error(e: BaseException, body) -> ApiError:
    """error_for, with `param` the body's own name for what the engine's message names."""
    err = error_for(e, set(type(body).model_fields))
    if err.param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        err.param = "max_completion_tokens"
    if err.param == "logprobs" and isinstance(body, ChatCompletionRequest):  # chat's count is top_logprobs
        err.param = "top_logprobs"
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


async def _maybe_off_loop(size: int, fn: Callable, *args: Any) -> Any:
    """fn(*args), in a worker thread when the input is long (tokenizing it takes long enough to stall streams)."""
    return await asyncio.to_thread(fn, *args) if size > LONG_PROMPT_CHARS else fn(*args)


def _check_unicode(text: str, field: str) -> None:
    """JSON may carry a lone surrogate ("\\ud800"), which no tokenizer takes; gRPC's UTF-8 strings cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{field} is not valid Unicode: {e.reason} at character {e.start}", field,
                       "invalid_value") from None
