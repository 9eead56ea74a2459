"""The OpenAI-compatible HTTP API: a FastAPI app on the gRPC server's AsyncEngine and event loop.

    POST /v1/completions, POST /v1/chat/completions   (streaming as server-sent events, or whole)
    GET  /v1/models, GET /v1/models/{name}, GET /health (200 only while SERVING)

A request becomes SamplingParams exactly as a gRPC one does, under the same limits (max_prompt_chars,
max_chat_messages, the queue's max_waiting_requests). Errors come in OpenAI's shape (http_models.ApiError):
a ValueError is 400 naming the field, a bad or missing API key 401, an unknown model or route 404, a full
queue 429, a server loading or draining 503. A client that disconnects, whether streaming or waiting for
a whole answer, leaves the engine's generator, which aborts the request and frees its blocks.

uvicorn serves it as a task on the server's own loop (HttpServer); the sidecar keeps SIGTERM (drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import socket
import time
import uuid
from typing import Any, AsyncIterator, Callable

import anyio
import structlog
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.runtime.engine.async_engine import LONG_PROMPT_CHARS, AsyncEngine, EngineStoppedError, QueueFullError
from pagedserve.runtime.kv_transfer.kv_connector import KVTransferError
from pagedserve.runtime.outputs import RequestOutput
from pagedserve.runtime.sampling_params import SamplingParams

from .http_models import ApiError, ChatCompletionRequest, CompletionRequest
from .http_render import ChatRender, CompletionRender, Render
from .servicer import CHAT_ROLES

log = structlog.get_logger("pagedserve.http")


# pydantic names the member of a union a value failed in ("str", "list[int]"): not a field, left out of `param`.
_TYPE_TAG = re.compile(r"str|int|float|bool|none|(list|dict|function-\w+)\[.*\]|list|dict")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


def error_for(e: BaseException, fields: set[str] | None = None) -> ApiError:
    """The OpenAI-shaped answer to an exception raised while preparing or running a request."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ValueError):  # SamplingParams, the engine's limits, the chat template: the message names it
        first = re.match(r"[A-Za-z_][\w.\[\]]*", str(e))
        name = first.group(0) if first else None
        param = name if name and (name.split("[")[0].split(".")[0] in (fields or set())) else None
        return ApiError(400, str(e), param, "invalid_value")
    if isinstance(e, QueueFullError):
        return ApiError(429, str(e), None, "queue_full")
    if isinstance(e, (EngineStoppedError, KVTransferError)):
        return ApiError(503, str(e), None, "unavailable")
    log.error("http.request_failed", error=repr(e))
    return ApiError(500, f"request failed: {e!r}", None, "internal_error")


class ApiKeyMiddleware:
    """Pure ASGI (streaming untouched): /v1/* needs "Authorization: Bearer KEY"; /health stays open."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                err = ApiError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                               None, "invalid_api_key")
                await JSONResponse(err.body(), 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HttpApi:
    def __init__(self, get_engine: Callable[[], AsyncEngine | None], model_name: Callable[[], str],
                 serving: Callable[[], bool], max_prompt_chars: int, max_chat_messages: int) -> None:
        self._get_engine, self._model_name, self._serving = get_engine, model_name, serving
        self.max_prompt_chars, self.max_chat_messages = max_prompt_chars, max_chat_messages
        self.created = int(time.time())

    def app(self, api_key: str | None = None):
        app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(ApiError, lambda _r, e: JSONResponse(e.body(), e.status))
        app.add_exception_handler(ClientGone, lambda _r, _e: Response(status_code=499))  # nobody reads it
        app.add_exception_handler(RequestValidationError, self._invalid)
        app.add_exception_handler(StarletteHTTPException, self._http_error)
        app.add_exception_handler(Exception, lambda _r, e: JSONResponse(error_for(e).body(), 500))
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{name:path}", self.model, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        return ApiKeyMiddleware(app, api_key) if api_key else app

    # -- errors -----------------------------------------------------------------------------------

    @staticmethod
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [p for p in first.get("loc", ()) if p != "body" and not _TYPE_TAG.fullmatch(str(p))]
        if first.get("type") == "json_invalid" or (loc and isinstance(loc[0], int)):
            return JSONResponse(ApiError(400, f"the body is not valid JSON: {first['msg']}", None,
                                         "invalid_json").body(), 400)
        if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
            return JSONResponse(ApiError(400, "the body must be a JSON object, sent with Content-Type: "
                                         "application/json", None, "invalid_json").body(), 400)
        param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        return JSONResponse(ApiError(400, message, param or None, "invalid_value").body(), 400)

    @staticmethod
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
                   else str(exc.detail))
        status = 404 if exc.status_code == 405 else exc.status_code
        return JSONResponse(ApiError(status, message, None, "not_found" if status == 404 else None).body(), status)

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

    # -- generation -------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        engine = self._prepare(body)
        prompt = self._completion_prompt(body.prompt)
        render = CompletionRender(f"cmpl-{uuid.uuid4().hex}", self._model_name(), body.return_token_ids)
        return await self._generate(request, engine, body, prompt, body.max_tokens, render)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        engine = self._prepare(body)
        messages = self._chat_messages(body)
        try:
            if sum(len(m["content"]) for m in messages) > LONG_PROMPT_CHARS:
                ids = await asyncio.to_thread(engine.tokenize_chat, messages, body.add_generation_prompt)
            else:
                ids = engine.tokenize_chat(messages, add_generation_prompt=body.add_generation_prompt)
        except ValueError as e:
            raise ApiError(400, str(e), "messages", "invalid_value") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        render = ChatRender(f"chatcmpl-{uuid.uuid4().hex}", self._model_name(), body.return_token_ids)
        return await self._generate(request, engine, body, ids, limit, render)

    def _prepare(self, body) -> AsyncEngine:
        engine = self._engine()
        self._check_model(body.model)
        if (name := body.unsupported()) is not None:
            raise ApiError(400, f"{name} is not supported by this server's HTTP API yet", name, "unsupported")
        return engine

    def _check_text(self, text: str, field: str) -> None:
        _check_unicode(text, field)
        if len(text) > self.max_prompt_chars:
            raise ApiError(400, f"{field} is {len(text)} characters; the limit is {self.max_prompt_chars}",
                           field, "invalid_value")

    def _completion_prompt(self, prompt) -> str | list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt holds {len(prompt)} prompts; this server takes one per request "
                               f"(send one request each)", "prompt", "unsupported")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "prompt is empty", "prompt", "invalid_value")
        if isinstance(prompt, str):
            self._check_text(prompt, "prompt")
        return prompt  # token ids: the engine checks their range and length before copying them

    def _chat_messages(self, body: ChatCompletionRequest) -> list[dict[str, str]]:
        if len(body.messages) > self.max_chat_messages:
            raise ApiError(400, f"messages has {len(body.messages)} messages; the limit is {self.max_chat_messages}",
                           "messages", "invalid_value")
        out, total = [], 0
        for i, m in enumerate(body.messages):
            if m.role not in CHAT_ROLES:
                raise ApiError(400, f"messages[{i}].role {m.role[:40]!r} is not one of {list(CHAT_ROLES)}",
                               f"messages[{i}].role", "invalid_value")
            text = m.text()
            self._check_text(text, f"messages[{i}].content")
            total += len(text)
            out.append({"role": m.role, "content": text})
        if total > self.max_prompt_chars:  # the rendered conversation is one prompt
            raise ApiError(400, f"messages hold {total} characters in all; the limit is {self.max_prompt_chars}",
                           "messages", "invalid_value")
        return out

    async def _generate(self, request: Request, engine: AsyncEngine, body, prompt: str | list[int],
                        max_tokens: int | None, render: Render):
        fields = set(type(body).model_fields)
        try:
            if max_tokens is None:  # the rest of the context, as vLLM does; a text prompt is tokenized once, here
                if isinstance(prompt, str):
                    prompt = (await asyncio.to_thread(engine.tokenize, prompt) if len(prompt) > LONG_PROMPT_CHARS
                              else engine.tokenize(prompt))
                max_tokens = max(1, engine.model_info().max_model_len - len(prompt))
            for i, stop in enumerate([body.stop] if isinstance(body.stop, str) else body.stop or []):
                _check_unicode(stop, f"stop[{i}]")
            params = SamplingParams(max_tokens=max_tokens, **body.sampling_kwargs())
        except ValueError as e:
            err = error_for(e, fields)
            if err.param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
                err.param = "max_completion_tokens"
            raise err from None
        outputs = engine.generate(render.request_id, prompt, params)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if not body.stream:
            async with contextlib.aclosing(outputs):
                last = await self._until_disconnect(request, lambda: _last(outputs), fields)
            return JSONResponse(render.whole(last, params.n))
        try:  # the first output before any header: refusals (bad input, full queue) get their status
            first = await self._until_disconnect(request, lambda: anext(outputs, None), fields)
        except BaseException:
            await outputs.aclose()
            raise
        return StreamingResponse(self._events(outputs, first, render, params.n, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @staticmethod
    async def _until_disconnect(request: Request, fn: Callable[[], Any], fields: set[str]) -> Any:
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
            raise error_for(errors[0], fields) from None
        if not result:
            raise ClientGone()
        return result[0]

    @staticmethod
    async def _events(outputs: AsyncIterator[RequestOutput], first: RequestOutput | None, render: Render,
                      n: int, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events; a disconnect cancels this generator, and leaving it aborts the request."""
        async with contextlib.aclosing(outputs):
            for event in render.start(n):
                yield _sse(event)
            last, out = None, first
            try:
                while out is not None:
                    last = out
                    for event in render.deltas(out):
                        yield _sse(event)
                    out = None if out.finished else await anext(outputs, None)
            except Exception as e:  # after the headers went out: the error is the stream's last event
                yield _sse(error_for(e).body())
                return
            for event in render.unfinished(n):  # aborted (the gRPC Abort RPC) without a final output
                yield _sse(event)
            if include_usage:
                yield _sse(render.usage_chunk(last))
            yield "data: [DONE]\n\n"


def _check_unicode(text: str, field: str) -> None:
    """JSON may carry a lone surrogate ("\\ud800"), which no tokenizer takes; gRPC's UTF-8 strings cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{field} is not valid Unicode: {e.reason} at character {e.start}", field,
                       "invalid_value") from None


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    last = None
    async for out in outputs:
        last = out
    return last


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the sidecar owns SIGTERM and SIGINT (they drain the whole server)
        yield


class HttpServer:
    """uvicorn on the running event loop, on a socket bound at construction (a taken port fails at start,
    and port 0 is known at once)."""

    def __init__(self, app, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=2048)
        self.sock.setblocking(False)
        self.address = f"http://{host if family == socket.AF_INET else f'[{host}]'}:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_keep_alive=5,
                                timeout_graceful_shutdown=2)
        self.server = _Uvicorn(config)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))

    async def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        if self.task is None:
            self.sock.close()
            return
        done, _ = await asyncio.wait([self.task], timeout=timeout)
        if not done:
            self.task.cancel()
