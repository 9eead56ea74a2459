"""Per-tenant quotas, checked when a request arrives (AsyncEngine.generate), before anything is allocated.

    max_concurrent_requests   the tenant's requests in flight (arrived, not yet ended)
    max_queued_requests       of those, the ones still without their first output (waiting or prefilling)
    tokens_per_minute         prompt + generated tokens of its requests that ended in the last 60 s

Over a quota the request is refused with QuotaExceededError, which carries a retry hint in seconds (the gRPC
server sends it as trailing metadata `retry-after-s`, the HTTP API as `Retry-After`); other tenants are
unaffected. A request's tokens count once it ends, so a tenant may pass tokens_per_minute by what its
requests in flight produce. The messages name no tenant and no key.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

WINDOW_S = 60.0


@dataclass(frozen=True)
class TenantQuota:
    max_concurrent_requests: int | None = None
    max_queued_requests: int | None = None
    tokens_per_minute: int | None = None


class QuotaExceededError(Exception):
    """The tenant is over one of its quotas; retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TenantQuotas:
    """Counts per tenant, on the event loop only (AsyncEngine's callers), so no lock."""

    def __init__(self, quotas: dict[str, TenantQuota], clock: Callable[[], float] = time.monotonic) -> None:
        self.quotas = quotas
        self.clock = clock
        self.in_flight: Counter[str] = Counter()
        self.queued: Counter[str] = Counter()
        self._ended: dict[str, deque[tuple[float, int]]] = {}  # (when, tokens) of requests that ended
        self._used: Counter[str] = Counter()  # tokens in _ended

    def _expire(self, tenant: str, now: float) -> None:
        ended = self._ended.get(tenant)
        while ended and ended[0][0] <= now - WINDOW_S:
            self._used[tenant] -= ended.popleft()[1]

    def admit(self, tenant: str) -> None:
        """Count a new request of `tenant`, or raise QuotaExceededError if it is over a quota."""
        q = self.quotas.get(tenant, TenantQuota())
        if q.max_concurrent_requests is not None and self.in_flight[tenant] >= q.max_concurrent_requests:
            raise QuotaExceededError(f"{self.in_flight[tenant]} of your requests are in flight "
                                     f"(max_concurrent_requests={q.max_concurrent_requests}); retry when one ends", 1.0)
        if q.max_queued_requests is not None and self.queued[tenant] >= q.max_queued_requests:
            raise QuotaExceededError(f"{self.queued[tenant]} of your requests are queued "
                                     f"(max_queued_requests={q.max_queued_requests}); retry shortly", 1.0)
        if q.tokens_per_minute is not None:
            now = self.clock()
            self._expire(tenant, now)
            if self._used[tenant] >= q.tokens_per_minute:
                # When enough of the window's oldest tokens fall out of it to bring the total under the quota.
                used, wait = self._used[tenant], WINDOW_S
                for when, tokens in self._ended[tenant]:
                    used -= tokens
                    if used < q.tokens_per_minute:
                        wait = when + WINDOW_S - now
                        break
                raise QuotaExceededError(f"your requests used {self._used[tenant]} tokens in the last minute "
                                         f"(tokens_per_minute={q.tokens_per_minute})", max(1.0, math.ceil(wait)))
        self.in_flight[tenant] += 1
        self.queued[tenant] += 1

    def started(self, tenant: str) -> None:
        """The request's first output came: it is no longer queued."""
        self.queued[tenant] -= 1

    def release(self, tenant: str, started: bool, tokens: int) -> None:
        """The request ended (finished, aborted, failed) after using `tokens` prompt + generated tokens."""
        self.in_flight[tenant] -= 1
        if not started:
            self.queued[tenant] -= 1
        if tokens and self.quotas.get(tenant, TenantQuota()).tokens_per_minute is not None:
            self._ended.setdefault(tenant, deque()).append((self.clock(), tokens))
            self._used[tenant] += tokens
