"""Which tenant a call comes from, what it may reach, and the names its requests live under.

    gRPC   the unix socket's peer credentials (peer_proxy.py); a TCP caller is the tenant "default"
    HTTP   the API key (TenantKeyMiddleware); an unknown key is 401, no key the tenant "default"
           (401 when --api-key is set, as without tenants)

Admin surfaces: every method of the gRPC service pagedserve.v1.Admin (AdminGuard, matched on the service name,
whatever methods it has) and the HTTP routes /v1/load_lora_adapter, /v1/unload_lora_adapter and /metrics
(whose labels name tenants) answer PERMISSION_DENIED / 403 to a tenant that is not an admin. Without a
tenants file every caller is the one default tenant and may reach all of it.

Isolation: a request id lives under its tenant (`scoped_id`), so Abort by another tenant finds nothing
(found=false, as for an id never used) and two tenants may use the same id; the prefix cache salt is the
tenant's name before the request's own cache_salt (`scoped_salt`), so tenants never share cache entries.
"""

from __future__ import annotations

import grpc

from pagedserve.runtime.core.sched_policy import DEFAULT_TENANT

from .peer_proxy import PeerProxy
from .tenants import Tenants

ADMIN_SERVICE = "pagedserve.v1.Admin"
ADMIN_HTTP_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/metrics")


def scoped_id(tenant: str | None, request_id: str) -> str:
    """The engine's id of a tenant's request (tenant names hold no '/', so the first '/' splits it)."""
    return request_id if tenant is None else f"{tenant}/{request_id}"


def scoped_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    return cache_salt if tenant is None else f"{tenant}/{cache_salt or ''}"


def is_admin_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in ADMIN_HTTP_PATHS)


class Callers:
    """The tenants file and the socket's peer table: who a gRPC call is, and whether it is an admin."""

    def __init__(self, tenants: Tenants | None, proxy: PeerProxy | None = None) -> None:
        self.tenants = tenants
        self.proxy = proxy

    def tenant(self, context) -> str | None:
        """None without a tenants file (nothing changes); else the caller's tenant, "default" when unknown."""
        if self.tenants is None:
            return None
        found = self.proxy.lookup(context.peer()) if self.proxy is not None else None
        return found[1] if found is not None else DEFAULT_TENANT

    def is_admin(self, tenant: str | None) -> bool:
        return self.tenants is None or tenant is None or self.tenants.is_admin(tenant)


def _guarded(behavior, callers: Callers):
    async def guarded(request_or_iterator, context):
        if not callers.is_admin(callers.tenant(context)):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this method is for admin tenants only")
        return await behavior(request_or_iterator, context)
    return guarded


class AdminGuard(grpc.aio.ServerInterceptor):
    """PERMISSION_DENIED for every method of pagedserve.v1.Admin unless the caller's tenant is an admin."""

    def __init__(self, callers: Callers) -> None:
        self.callers = callers

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{ADMIN_SERVICE}/"):
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_guarded(handler.unary_unary, self.callers),
                                                       handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:  # streams: checked before the first message
            inner = handler.unary_stream

            async def stream(request, context):
                if not self.callers.is_admin(self.callers.tenant(context)):
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this method is for admin tenants only")
                async for item in inner(request, context):
                    yield item
            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        # Client-streaming methods: refuse them to everyone rather than leave one unguarded.
        async def refuse(_request, context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this method is not available")
        return grpc.unary_unary_rpc_method_handler(refuse, handler.request_deserializer, handler.response_serializer)
