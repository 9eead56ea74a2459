"""The tenants file (--tenants tenants.toml): who may call, their share, quotas and rights.

    [tenants.chat]                     # a tenant's name: letters, digits, '.', '_', '-' (at most 64)
    uids = [1001]                      # unix socket callers by the peer's uid (SO_PEERCRED) ...
    gids = [2001]                      # ... or by its primary gid (a uid match wins over a gid match)
    api_keys = ["sk-chat-1"]           # HTTP callers by "Authorization: Bearer KEY"
    weight = 2.0                       # --scheduling-policy fair: its share (default 1)
    admin = false                      # may call pagedserve.v1.Admin and /v1/(un)load_lora_adapter
    max_concurrent_requests = 64       # quotas (runtime/engine/tenant_quotas.py); unset = no limit
    max_queued_requests = 32
    tokens_per_minute = 200000

A caller matching no tenant is the tenant "default" (configure it as [tenants.default]; it is not an admin
unless said so). Without a file every caller is that one default tenant and nothing changes. A file the
server cannot use is refused at start, its message naming the key (and its line where the file shows it).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.runtime.core.sched_policy import DEFAULT_TENANT
from pagedserve.runtime.engine.tenant_quotas import TenantQuota

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_INT_KEYS = ("max_concurrent_requests", "max_queued_requests", "tokens_per_minute")
_KEYS = {"uids", "gids", "api_keys", "weight", "admin", *_INT_KEYS}


@dataclass(frozen=True)
class Tenant:
    name: str
    uids: tuple[int, ...] = ()
    gids: tuple[int, ...] = ()
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never printed
    weight: float = 1.0
    admin: bool = False
    quota: TenantQuota = TenantQuota()


@dataclass(frozen=True)
class Tenants:
    """The parsed file; `by_uid`, `by_gid` and `by_key` answer who a caller is."""

    tenants: dict[str, Tenant]

    def __post_init__(self) -> None:
        self.tenants.setdefault(DEFAULT_TENANT, Tenant(DEFAULT_TENANT))
        object.__setattr__(self, "by_uid", {u: t.name for t in self.tenants.values() for u in t.uids})
        object.__setattr__(self, "by_gid", {g: t.name for t in self.tenants.values() for g in t.gids})
        object.__setattr__(self, "by_key", {k: t.name for t in self.tenants.values() for k in t.api_keys})

    def for_peer(self, uid: int, gid: int) -> str:
        return self.by_uid.get(uid) or self.by_gid.get(gid) or DEFAULT_TENANT

    def for_api_key(self, key: str | None) -> str | None:
        """The key's tenant; None for a key no tenant holds (the caller gets 401)."""
        return self.by_key.get(key) if key else None

    def is_admin(self, name: str) -> bool:
        return self.tenants[name].admin

    @property
    def weights(self) -> dict[str, float]:
        return {n: t.weight for n, t in self.tenants.items()}

    @property
    def quotas(self) -> dict[str, TenantQuota]:
        return {n: t.quota for n, t in self.tenants.items()}


class TenantsFileError(ValueError):
    pass


def _line(text: str, table: str, key: str | None = None) -> str:
    """' (line N)' of the table header or of the key inside it, when the text shows it plainly."""
    lines = text.splitlines()
    header = re.compile(r"\s*\[\s*tenants\s*\.\s*(\"?)" + re.escape(table) + r"\1\s*\]")
    for i, line in enumerate(lines):
        if header.match(line):
            if key is None:
                return f" (line {i + 1})"
            for j in range(i + 1, len(lines)):
                if lines[j].lstrip().startswith("["):
                    break
                if re.match(r"\s*" + re.escape(key) + r"\s*=", lines[j]):
                    return f" (line {j + 1})"
            return f" (line {i + 1})"
    return ""


def parse_tenants(text: str, source: str = "tenants file") -> Tenants:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # its message carries the line and column
        raise TenantsFileError(f"{source}: not valid TOML: {e}") from None
    extra = set(doc) - {"tenants"}
    if extra:
        raise TenantsFileError(f"{source}: unknown top-level key {sorted(extra)[0]!r}; expected [tenants.NAME] tables")
    tables = doc.get("tenants", {})
    if not isinstance(tables, dict) or not tables:
        raise TenantsFileError(f"{source}: no tenants: add a [tenants.NAME] table for each")
    tenants: dict[str, Tenant] = {}
    seen: dict[tuple[str, object], str] = {}
    for name, t in tables.items():
        where = f"{source}: tenants.{name}"
        if not NAME.fullmatch(name):
            raise TenantsFileError(f"{where}{_line(text, name)}: a tenant's name is 1-64 letters, digits, "
                                   f"'.', '_' or '-'")
        if not isinstance(t, dict):
            raise TenantsFileError(f"{where}{_line(text, name)}: must be a table")
        for key in t:
            if key not in _KEYS:
                raise TenantsFileError(f"{where}.{key}{_line(text, name, key)}: unknown key; the keys are "
                                       f"{sorted(_KEYS)}")

        def bad(key: str, want: str) -> TenantsFileError:
            return TenantsFileError(f"{where}.{key}{_line(text, name, key)}: must be {want}")

        ids = {}
        for key in ("uids", "gids"):
            v = t.get(key, [])
            if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
                raise bad(key, "a list of non-negative integers")
            ids[key] = tuple(v)
        keys = t.get("api_keys", [])
        if not isinstance(keys, list) or any(not isinstance(k, str) or len(k) < 8 for k in keys):
            raise bad("api_keys", "a list of strings of at least 8 characters")
        for kind, values in (("uids", ids["uids"]), ("gids", ids["gids"]), ("api_keys", keys)):
            for v in values:
                if (kind, v) in seen:  # the key itself is never printed
                    shown = "an API key" if kind == "api_keys" else f"{kind[:-1]} {v}"
                    raise TenantsFileError(f"{where}.{kind}{_line(text, name, kind)}: {shown} is also "
                                           f"tenant {seen[kind, v]!r}'s")
                seen[kind, v] = name
        weight = t.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
            raise bad("weight", "a positive number")
        admin = t.get("admin", False)
        if not isinstance(admin, bool):
            raise bad("admin", "true or false")
        limits = {}
        for key in _INT_KEYS:
            v = t.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise bad(key, "a positive integer")
            limits[key] = v
        tenants[name] = Tenant(name, ids["uids"], ids["gids"], tuple(keys), float(weight), admin, TenantQuota(**limits))
    return Tenants(tenants)


def load_tenants(path: str) -> Tenants:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TenantsFileError(f"--tenants {path}: cannot read it: {e}") from None
    return parse_tenants(text, f"--tenants {path}")
