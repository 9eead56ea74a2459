"""Tenants end to end: a real `pagedserve serve --tenants FILE` with the socket, TCP and the HTTP API.

This process (uid 0) is the tenant "app" on the unix socket (its peer credentials); on TCP it has no
credentials, so it is the tenant "default" there: two tenants from one test process.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from http_helpers import http_address
from pagedserve.sidecar.client import PagedServeClient
from pagedserve.sidecar.pb import generation_pb2 as pb
from pagedserve.sidecar.pb import generation_pb2_grpc as pb_grpc
from server_proc import ServerProcess, client_for, wait_idle

APP_KEY, OPS_KEY = "sk-app-key-0001", "sk-ops-key-0001"
TENANTS = f"""
[tenants.app]
uids = [0]
api_keys = ["{APP_KEY}"]
max_concurrent_requests = 2

[tenants.ops]
api_keys = ["{OPS_KEY}"]
admin = true
"""


def _tcp_address(srv: ServerProcess) -> str:
    for line in srv.log().splitlines():
        if '"server.listening"' in line:
            return next(a for a in json.loads(line)["addresses"] if a.startswith("127.0.0.1:"))
    raise AssertionError(srv.log())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    (tmp / "tenants.toml").write_text(TENANTS)
    srv = ServerProcess(tmp, "--max-model-len", "512", "--tenants", str(tmp / "tenants.toml"), "--tcp",
                        "127.0.0.1:0", "--http-port", "0", "--scheduling-policy", "fair")
    srv.wait_serving()
    srv.http = http_address(srv)
    srv.tcp = _tcp_address(srv)
    yield srv
    assert srv.stop() == 0, srv.log()


LONG = dict(max_tokens=400, temperature=0.0, ignore_eos=True)


def test_a_tenant_cannot_abort_another_tenants_request(server):
    with client_for(server) as app, PagedServeClient(server.tcp) as other:
        mine = app.generate([5, 6, 7], request_id="job-1", **LONG)
        assert next(mine).token_ids
        assert other.abort("job-1") is False  # as for an id never used: its existence is not revealed
        theirs = other.generate([5, 6, 7], request_id="job-1", max_tokens=4, temperature=0.0, ignore_eos=True)
        assert [t for ch in theirs for t in ch.token_ids]  # the same id, its own request: no "in use"
        assert next(mine).token_ids  # still running
        assert app.abort("job-1") is True
        assert list(mine)[-1].finish_reason == "abort"
        assert wait_idle(app).kv_blocks_used == 0


def test_a_tenant_over_its_quota_gets_resource_exhausted_with_a_retry_hint_others_do_not(server):
    with client_for(server) as app, PagedServeClient(server.tcp) as other:
        streams = [app.generate([5, 6, 7], request_id=f"q{i}", **LONG) for i in range(2)]
        for s in streams:
            assert next(s).token_ids
        with grpc.insecure_channel(f"unix:{server.socket}") as ch:
            call = pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                text="hello", sampling=pb.SamplingParams(max_tokens=2)), timeout=30)
            with pytest.raises(grpc.RpcError) as err:
                list(call)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_concurrent_requests=2" in err.value.details() and "app" not in err.value.details()
        assert dict(err.value.trailing_metadata())["retry-after-s"] == "1"
        assert other.generate_text("hello", max_tokens=2, temperature=0.0)  # another tenant: unharmed
        # The same tenant over HTTP (its key): the same quota, 429 with Retry-After.
        req = urllib.request.Request(server.http + "/v1/completions", data=json.dumps({"prompt": "hi"}).encode(),
                                     headers={"Authorization": f"Bearer {APP_KEY}", "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(req, timeout=60)
        assert http_err.value.code == 429 and http_err.value.headers["Retry-After"] == "1"
        assert json.loads(http_err.value.read())["error"]["code"] == "quota_exceeded"
        for i in range(2):
            assert app.abort(f"q{i}") is True
        for s in streams:
            assert list(s)[-1].finish_reason == "abort"
        assert wait_idle(app).kv_blocks_used == 0


def test_server_stats_show_the_callers_own_tenant_only(server):
    """GetServerStats carries the caller's own tenant row: "app" sees its running request and tokens; the TCP
    caller ("default") sees its own zeros and never the name or the figures of "app"."""
    with client_for(server) as app, PagedServeClient(server.tcp) as other:
        mine = app.generate([5, 6, 7], request_id="stats-1", **LONG)
        assert next(mine).token_ids
        seen = None
        for _ in range(200):  # bounded: the engine's snapshot follows within a few steps
            seen = app.server_stats()
            if seen.tenant_num_running == 1 and seen.tenant_tokens_served >= 4:
                break
            next(mine)
        assert seen.tenant == "app" and seen.tenant_num_running == 1 and seen.tenant_tokens_served >= 4, seen
        theirs = other.server_stats()
        assert theirs.tenant == "default" and theirs.tenant_num_running == 0, theirs
        assert theirs.num_running >= 1  # the engine-wide figures stay engine-wide
        assert app.abort("stats-1") is True
        assert list(mine)[-1].finish_reason == "abort"
        assert wait_idle(app).tenant_num_running == 0


def test_priority_is_taken_from_the_request(server):
    with grpc.insecure_channel(f"unix:{server.socket}") as ch:
        chunks = list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6, 7]), priority=-3,
            sampling=pb.SamplingParams(max_tokens=2, temperature=0.0)), timeout=30))
    assert chunks[-1].HasField("usage") and chunks[-1].usage.completion_tokens == 2


class Answer:
    def __init__(self, status_code: int, text: str) -> None:
        self.status_code, self.text = status_code, text

    def json(self) -> dict:
        return json.loads(self.text)


def _http(server, path: str, key: str | None, body: dict | None = None) -> Answer:
    """POST `body` (GET when None) with the key as a Bearer token."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    req = urllib.request.Request(server.http + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return Answer(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read().decode())


def _post(server, path: str, key: str | None, body: dict | None = None) -> Answer:
    return _http(server, path, key, body or {})


def test_http_identity_by_key_admin_routes_and_metrics(server):
    body = {"prompt": "hello", "max_tokens": 2, "temperature": 0.0, "priority": 1}
    r = _post(server, "/v1/completions", "sk-nobody-knows-this")
    assert r.status_code == 401 and "sk-nobody" not in r.text
    assert _post(server, "/v1/completions", APP_KEY, body).status_code == 200
    assert _post(server, "/v1/completions", None, body).status_code == 200  # no key: the tenant "default"
    # The admin routes are guarded before any LoRA code exists: 403 for others, past the guard (404) for ops.
    r = _post(server, "/v1/load_lora_adapter", APP_KEY, {"lora_name": "x", "lora_path": "/x"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    assert _post(server, "/v1/unload_lora_adapter", OPS_KEY, {"lora_name": "x"}).status_code == 404
    # /metrics names tenants: admins only; its labels are the file's names, never a key.
    assert _http(server, "/metrics", APP_KEY).status_code == 403
    text = _http(server, "/metrics", OPS_KEY).text
    assert 'pagedserve_tenant_requests_total{outcome="stop",tenant="default"}' in text \
        or 'pagedserve_tenant_requests_total{outcome="length",tenant="default"}' in text
    assert 'pagedserve_tenant_tokens_total{kind="generation",tenant="app"}' in text  # HTTP requests count too
    assert APP_KEY not in text and OPS_KEY not in text
    assert APP_KEY not in server.log() and OPS_KEY not in server.log()
    with client_for(server) as c:
        assert c.health() == "SERVING" and wait_idle(c).kv_blocks_used == 0


def test_a_malformed_tenants_file_stops_the_server_at_start_with_the_key_and_line(tmp_path):
    (tmp_path / "bad.toml").write_text("[tenants.app]\nuids = [0]\nweight = 0\n")
    srv = ServerProcess(tmp_path, "--tenants", str(tmp_path / "bad.toml"))
    assert srv.proc.wait(60) != 0
    assert "tenants.app.weight (line 3): must be a positive number" in srv.log()
    srv.stop()
