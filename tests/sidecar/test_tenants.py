"""Tenants: the file, quotas, the socket's peer credentials and the admin guard (no model loaded)."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile

import grpc
import pytest

from pagedserve.runtime.engine.tenant_quotas import QuotaExceededError, TenantQuota, TenantQuotas
from pagedserve.sidecar.peer_proxy import PeerCred, PeerProxy, private_socket_path
from pagedserve.sidecar.tenant_access import AdminGuard, Callers, is_admin_path, scoped_id, scoped_salt
from pagedserve.sidecar.tenants import TenantsFileError, parse_tenants

GOOD = """
[tenants.chat]
uids = [1001]
api_keys = ["sk-chat-secret-1"]
weight = 2
admin = false
max_concurrent_requests = 4

[tenants.ops]
gids = [0]
api_keys = ["sk-ops-secret-1"]
admin = true
"""


def test_a_good_file_maps_uids_gids_and_keys():
    t = parse_tenants(GOOD)
    assert set(t.tenants) == {"chat", "ops", "default"}  # callers matching nobody are "default"
    assert t.for_peer(1001, 5) == "chat" and t.for_peer(7, 0) == "ops" and t.for_peer(7, 7) == "default"
    assert t.for_peer(1001, 0) == "chat"  # a uid match wins over a gid match
    assert t.for_api_key("sk-chat-secret-1") == "chat" and t.for_api_key("sk-nobody-123") is None
    assert t.weights == {"chat": 2.0, "ops": 1.0, "default": 1.0}
    assert t.quotas["chat"].max_concurrent_requests == 4 and t.is_admin("ops") and not t.is_admin("default")
    assert "sk-chat-secret-1" not in repr(t)  # keys are never printed


@pytest.mark.parametrize("text, message", [
    ("[tenants.chat]\nuids = [1001\n", "not valid TOML"),
    ("[tenants.chat]\nuids = [1]\nweight = -1\n", "tenants.chat.weight (line 3): must be a positive number"),
    ("[tenants.chat]\nuid = [1]\n", "tenants.chat.uid (line 2): unknown key"),
    ("[tenants.chat]\nuids = [\"x\"]\n", "tenants.chat.uids (line 2): must be a list of non-negative integers"),
    ("[tenants.\"a/b\"]\nuids = [1]\n", "a tenant's name is 1-64 letters"),
    ("[tenants.a]\nuids = [1]\n[tenants.b]\nuids = [1]\n", "tenants.b.uids (line 4): uid 1 is also tenant 'a'"),
    ("[tenants.a]\nmax_queued_requests = 0\n", "tenants.a.max_queued_requests (line 2): must be a positive integer"),
    ("[tenants.a]\nadmin = \"yes\"\n", "tenants.a.admin (line 2): must be true or false"),
    ("weight = 1\n", "unknown top-level key 'weight'"),
    ("", "no tenants"),
])
def test_a_malformed_file_is_refused_naming_the_key_and_line(text, message):
    with pytest.raises(TenantsFileError) as err:
        parse_tenants(text)
    assert message in str(err.value)


def test_a_shared_api_key_is_refused_without_printing_it():
    with pytest.raises(TenantsFileError) as err:
        parse_tenants('[tenants.a]\napi_keys = ["sk-shared-key"]\n[tenants.b]\napi_keys = ["sk-shared-key"]\n')
    assert "an API key is also tenant 'a'" in str(err.value) and "sk-shared-key" not in str(err.value)
    with pytest.raises(TenantsFileError, match="at least 8 characters"):
        parse_tenants('[tenants.a]\napi_keys = ["short"]\n')


def test_ids_and_salts_live_under_the_tenant():
    assert scoped_id(None, "x") == "x" and scoped_salt(None, "s") == "s"  # no tenants file: nothing changes
    assert scoped_id("a", "x") != scoped_id("b", "x")
    assert scoped_salt("a", None) != scoped_salt("b", None) and scoped_salt("a", "s") != scoped_salt("b", "s")
    assert scoped_salt("default", "a/") != scoped_salt("a", None)  # a caller's own salt cannot reach a's entries
    assert is_admin_path("/v1/load_lora_adapter") and is_admin_path("/metrics")
    assert not is_admin_path("/v1/completions") and not is_admin_path("/v1/load_lora_adapterX")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_quotas_refuse_over_the_limit_with_a_retry_hint_and_leave_others_alone():
    clock = Clock()
    q = TenantQuotas({"a": TenantQuota(max_concurrent_requests=2, max_queued_requests=1, tokens_per_minute=100)},
                     clock)
    q.admit("a")
    with pytest.raises(QuotaExceededError, match="max_queued_requests=1"):
        q.admit("a")  # the first is still queued
    q.started("a")
    q.admit("a")
    q.started("a")
    with pytest.raises(QuotaExceededError, match="max_concurrent_requests=2") as err:
        q.admit("a")
    assert err.value.retry_after_s > 0
    for _ in range(5):
        q.admit("b")  # another tenant: no quota, unaffected
    q.release("a", True, 60)
    clock.now += 10
    q.release("a", True, 50)
    with pytest.raises(QuotaExceededError, match="used 110 tokens") as err:
        q.admit("a")
    assert err.value.retry_after_s == 50  # the first 60 tokens leave the window 60 s after they were counted
    clock.now += 50
    q.admit("a")
    assert q.in_flight["a"] == 1 and q.queued["a"] == 1


class _Who:
    """A stand-in service: answers with who the server thinks is calling."""

    def __init__(self, callers: Callers) -> None:
        self.callers = callers

    async def whoami(self, request: bytes, context) -> bytes:
        cred, tenant = self.callers.proxy.lookup(context.peer()) or (None, self.callers.tenant(context))
        return f"{tenant} {cred.uid} {cred.pid}".encode() if cred else f"{tenant}".encode()

    async def load(self, request: bytes, context) -> bytes:
        return b"loaded"


def _raw(fn):
    return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=None, response_serializer=None)


async def _serve(tenants_text: str, folder: str):
    tenants = parse_tenants(tenants_text)
    public = os.path.join(folder, "ps.sock")
    private = private_socket_path(public)
    seen: list[PeerCred] = []

    def identify(cred: PeerCred) -> str:
        seen.append(cred)
        return tenants.for_peer(cred.uid, cred.gid)

    callers = Callers(tenants, PeerProxy(public, private, identify))
    server = grpc.aio.server(interceptors=[AdminGuard(callers)])
    who = _Who(callers)
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler("test.Who", {"Whoami": _raw(who.whoami)}),
        # Any method of pagedserve.v1.Admin, the LoRA branch's or a dummy one: the guard matches the service name.
        grpc.method_handlers_generic_handler("pagedserve.v1.Admin", {"LoadLoRAAdapter": _raw(who.load)})])
    server.add_insecure_port(f"unix:{private}")
    await server.start()
    await callers.proxy.start()
    os.chmod(public, 0o666)
    return server, callers, public, seen


async def _call(public: str, method: str) -> bytes:
    async with grpc.aio.insecure_channel(f"unix:{public}") as ch:
        return await ch.unary_unary(method)(b"", timeout=10)


@pytest.mark.parametrize("admin", [False, True])
def test_the_admin_service_is_for_admin_tenants_only(admin):
    async def main():
        with tempfile.TemporaryDirectory() as folder:
            text = f"[tenants.me]\nuids = [{os.getuid()}]\nadmin = {str(admin).lower()}\n"
            server, callers, public, _ = await _serve(text, folder)
            try:
                assert await _call(public, "/test.Who/Whoami") == f"me {os.getuid()} {os.getpid()}".encode()
                if admin:
                    assert await _call(public, "/pagedserve.v1.Admin/LoadLoRAAdapter") == b"loaded"
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await _call(public, "/pagedserve.v1.Admin/LoadLoRAAdapter")
                    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert "me" not in err.value.details().split()  # no tenant named in the answer
            finally:
                await server.stop(None)
                await callers.proxy.stop()
            assert not callers.proxy.peers  # every relayed connection is forgotten
    asyncio.run(main())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child under another uid")
def test_so_peercred_is_read_from_a_second_process_under_another_uid():
    """A forked child drops to uid/gid 65534 before it connects; the server reads those ids from the kernel,
    not from anything the child sends, and maps them to the tenant the file gives uid 65534."""

    async def main():
        with tempfile.TemporaryDirectory() as folder:
            os.chmod(folder, 0o755)
            server, callers, public, seen = await _serve("[tenants.nobody]\nuids = [65534]\n", folder)
            try:
                pid = os.fork()
                if pid == 0:  # the child: socket calls only, then out
                    code = 1
                    try:
                        os.setgid(65534)
                        os.setuid(65534)
                        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        s.connect(public)
                        s.sendall(b"PRI * HTTP/2.0\r\n\r\n")  # what a gRPC client says first; then hang up
                        s.close()
                        code = 0
                    finally:
                        os._exit(code)
                for _ in range(500):  # bounded: the child's connection shows up within moments
                    if seen:
                        break
                    await asyncio.sleep(0.01)
                _, status = await asyncio.to_thread(os.waitpid, pid, 0)
                assert os.waitstatus_to_exitcode(status) == 0
                assert seen == [PeerCred(pid=pid, uid=65534, gid=65534)]
                assert callers.tenants.for_peer(seen[0].uid, seen[0].gid) == "nobody"
                # The server is still up for the next caller (root: the tenant "default").
                assert await _call(public, "/test.Who/Whoami") == f"default 0 {os.getpid()}".encode()
            finally:
                await server.stop(None)
                await callers.proxy.stop()
    asyncio.run(main())


def test_without_a_tenants_file_everyone_is_nobody_in_particular_and_may_do_everything():
    callers = Callers(None)
    assert callers.tenant(None) is None and callers.is_admin(None)


def test_a_quota_refusal_is_an_http_429_with_retry_after():
    from pagedserve.sidecar.http_errors import error_for

    err = error_for(QuotaExceededError("your requests used 120 tokens in the last minute", 12.2))
    assert (err.status, err.code, err.headers) == (429, "quota_exceeded", {"Retry-After": "13"})
    assert err.body()["error"]["type"] == "rate_limit_error"
