"""Every HTTP answer in pagedserve_requests_total{interface="http", outcome}: one ASGI middleware, outermost, so
what the inner middlewares refuse (401 ApiKeyMiddleware, 413 BodyLimitMiddleware) and what no route takes (404)
is counted as surely as what the engine ran.

    a request that reached the engine   its engine requests' outcomes (one per prompt: stop, length, abort,
                                        cancelled, or the engine's refusal), recorded by http_generate.py in
                                        the list this middleware puts in the scope
    any other answer >= 400             one outcome by its status (STATUS_OUTCOMES; other 4xx invalid_argument,
                                        5xx internal); a client gone before any answer is cancelled
    any other answer < 400              not counted (models, tokenize: nothing was generated)

/health and /metrics are never counted (probes and scrapes would drown the rest). The path is never a label.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .metrics import ServerMetrics

# The scope key of the list a generation route appends its engine requests' outcomes to.
OUTCOMES_KEY = "pagedserve.outcomes"
NOT_COUNTED = ("/health", "/metrics")
# The outcome names are the gRPC path's (its status codes, lower case) where it has one.
STATUS_OUTCOMES = {400: "invalid_argument", 401: "unauthenticated", 404: "not_found", 413: "too_large",
                   429: "resource_exhausted", 499: "cancelled", 503: "unavailable"}


def outcome_for_status(status: int | None) -> str | None:
    """The outcome of an answer that reached no engine; None for a success (not counted)."""
    if status is None:
        return "cancelled"  # the client left before any answer
    if status < 400:
        return None
    return STATUS_OUTCOMES.get(status, "internal" if status >= 500 else "invalid_argument")


class OutcomeMiddleware:
    """Pure ASGI (streams pass through untouched): counts each request once its answer is over."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in NOT_COUNTED:
            await self.app(scope, receive, send)
            return
        outcomes: list[str] = []
        scope[OUTCOMES_KEY] = outcomes  # a list: shared even where a layer copies the scope
        status: int | None = None

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except asyncio.CancelledError:  # the server cancelled the request: its client left
            raise
        except Exception:
            status = status or 500  # starlette's ServerErrorMiddleware answered 500 on its way out
            raise
        finally:
            if not outcomes:
                outcome = outcome_for_status(status)
                outcomes = [outcome] if outcome is not None else []
            for outcome in outcomes:
                self.metrics.count_request("http", outcome)
