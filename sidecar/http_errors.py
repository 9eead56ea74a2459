"""The HTTP API's error answers, in OpenAI's shape (http_models.ApiError), and the two ASGI middlewares that
answer before the app runs.

    400  a bad field, named in `param` (pydantic's type checks, SamplingParams' ranges, the engine's limits)
    401  no or a wrong API key (ApiKeyMiddleware)
    404  an unknown model or route (405 is answered 404 too: no route takes that method)
    413  a body larger than the limit (BodyLimitMiddleware), counted before anything parses it
    429  the engine's queue is full (QueueFullError: the gRPC path's RESOURCE_EXHAUSTED)
    503  loading or draining (EngineStoppedError: the gRPC path's UNAVAILABLE)

Anything else is a bug in this server: logged, answered 500 with its repr, and the server carries on.
"""

from __future__ import annotations

import math
import re
import secrets

import structlog
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.runtime.engine.async_engine import EngineStoppedError, QueueFullError
from pagedserve.runtime.engine.tenant_quotas import QuotaExceededError
from pagedserve.runtime.kv_transfer.kv_connector import KVTransferError

from .http_messages import ROLES, TEXT_ONLY
from .http_models import ApiError

log = structlog.get_logger("pagedserve.http")

# pydantic names the member of a union a value failed in ("str", "list[int]"): not a field, left out of `param`.
_TYPE_TAG = re.compile(r"str|int|float|bool|none|(list|dict|function-\w+)\[.*\]|list|dict|literal\[.*\]|"
                       r"[A-Z]\w*")


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
    if isinstance(e, QuotaExceededError):  # this tenant's quota (runtime/engine/tenant_quotas.py)
        return ApiError(429, str(e), None, "quota_exceeded", {"Retry-After": str(math.ceil(e.retry_after_s))})
    if isinstance(e, (EngineStoppedError, KVTransferError)):
        return ApiError(503, str(e), None, "unavailable")
    log.error("http.request_failed", error=repr(e))
    return ApiError(500, f"request failed: {e!r}", None, "internal_error")


async def invalid_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's first complaint, with its field path as `param` (messages[0].role, tools[1].function)."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = _field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid" or (loc and isinstance(loc[0], int)):
        return JSONResponse(ApiError(400, f"the body is not valid JSON: {first['msg']}", None,
                                     "invalid_json").body(), 400)
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        return JSONResponse(ApiError(400, "the body must be a JSON object, sent with Content-Type: "
                                     "application/json", None, "invalid_json").body(), 400)
    kind = str(first.get("type"))
    if kind in ("union_tag_invalid", "union_tag_not_found"):  # a message's role: name the field it is read from
        loc.append(str(first.get("ctx", {}).get("discriminator", "")).strip("'") or "role")
    elif kind == TEXT_ONLY:  # an image/audio/file part: its type is what is refused
        loc.append("type")
    param = "".join(f"[{p}]" if isinstance(p, int) or (i and str(p).isdigit()) else (f".{p}" if i else str(p))
                    for i, p in enumerate(loc))  # a digit key is a token id: logit_bias[5], as the engine names it
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    code = "unsupported" if kind == TEXT_ONLY else "invalid_type" if kind.endswith("_type") else "invalid_value"
    return JSONResponse(ApiError(400, message, param or None, code).body(), 400)


def _field_path(loc) -> list:
    """pydantic's error location as the body's field path: without "body", the union members pydantic names
    ("str", "list[int]", "NamedToolChoice") and the role a message was read as (messages.0.user.content)."""
    path: list = []
    for p in loc:
        if p == "body" and not path or _TYPE_TAG.fullmatch(str(p)):
            continue
        if p in ROLES and len(path) >= 2 and isinstance(path[-1], int) and path[-2] == "messages":
            continue
        path.append(p)
    return path


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
               else str(exc.detail))
    status = 404 if exc.status_code == 405 else exc.status_code
    return JSONResponse(ApiError(status, message, None, "not_found" if status == 404 else None).body(), status)


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


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes, before any of it is parsed: at once from Content-Length, else
    (chunked) as the bytes arrive, when the app is told the client left so it stops reading and the answer it
    would give is dropped. The rest of the body is read and thrown away (up to DRAIN_BYTES), so a client that
    sends its whole body before reading (most do) gets the 413 instead of a broken pipe."""

    DRAIN_BYTES = 64 << 20

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def _refuse(self, size: str, scope, receive, send, drained: int = 0, more: bool = True) -> None:
        while more and drained <= self.DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left: nobody to answer
            drained += len(message.get("body", b""))
            more = message.get("more_body", False)
        err = ApiError(413, f"the request body is {size} bytes; the limit is {self.limit} bytes (4 bytes per "
                       f"character of max_prompt_chars, plus 1 MiB)", None, "body_too_large")
        await JSONResponse(err.body(), 413, headers={"Connection": "close"})(scope, receive, send)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._refuse(length.decode(), scope, receive, send)
            return
        seen, refused = 0, False

        async def counting_receive():
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    refused = True
                    await self._refuse(f"more than {self.limit}", scope, receive, send, seen,
                                       message.get("more_body", False))
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)
