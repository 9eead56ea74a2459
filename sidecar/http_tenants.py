"""HTTP identity with a tenants file: the Bearer key names the tenant (sidecar/tenant_access.py has the rules)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from pagedserve.runtime.core.sched_policy import DEFAULT_TENANT

from .http_models import ApiError
from .tenant_access import is_admin_path
from .tenants import Tenants


def _bearer(scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            text = value.decode("latin-1")
            return text[7:].strip() if text[:7].lower() == "bearer " else ""
    return None


class TenantKeyMiddleware:
    """HTTP identity: the Bearer key's tenant in scope["state"]["tenant"]; 401 for an unknown key (never echoed),
    403 on an admin route for a tenant that is not an admin."""

    def __init__(self, app, tenants: Tenants, api_key: str | None = None) -> None:
        self.app, self.tenants, self.api_key = app, tenants, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key = _bearer(scope)
        tenant = self.tenants.for_api_key(key)
        path = scope.get("path", "")
        # As ApiKeyMiddleware: without a key, only /v1/* and admin routes need --api-key (/health stays open).
        guarded = path.startswith("/v1") or is_admin_path(path)
        if tenant is None and ((key and key != self.api_key) or (not key and self.api_key and guarded)):
            err = ApiError(401, "a valid API key is required: send 'Authorization: Bearer KEY'", None,
                           "invalid_api_key")
            return await JSONResponse(err.body(), 401)(scope, receive, send)
        tenant = tenant or DEFAULT_TENANT
        if is_admin_path(path) and not self.tenants.is_admin(tenant):
            err = ApiError(403, "this route is for admin tenants only", None, "permission_denied")
            return await JSONResponse(err.body(), 403)(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
