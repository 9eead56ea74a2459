"""pagedserve_requests_total counts every outcome, by interface: 10 requests of each kind move their counter by
exactly 10, the refusals made before the engine (pydantic's 400, the API key's 401, an unknown route's or model's
404, the body limit's 413) as surely as the engine's own. A live server on the tiny model for what it reaches
cheaply; the HTTP app and the gRPC servicer in-process, over a stub engine, for a full queue and a loading model."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import pytest
from http_helpers import http_address
from server_proc import ServerProcess, client_for

from pagedserve.runtime.engine.async_engine import QueueFullError
from pagedserve.sidecar.client import PagedServeError
from pagedserve.sidecar.metrics import ServerMetrics

KEY = "sesame"
N = 10


def call(url: str, body=None, raw: bytes | None = None, key: str | None = KEY) -> int:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def counts(text: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.labels["interface"], s.labels["outcome"]): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "pagedserve_requests_total"}


def moved(before: dict, after: dict) -> dict[tuple[str, str], float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


@pytest.mark.slow
def test_ten_of_each_outcome_counted_once_by_interface(tmp_path):
    srv = ServerProcess(tmp_path, "--http-port", "0", "--api-key", KEY, "--max-prompt-chars", "2000")
    srv.wait_serving()
    try:
        http = http_address(srv)
        scrape = lambda: counts(urllib.request.urlopen(http + "/metrics", timeout=30).read().decode())  # noqa: E731
        before = scrape()
        ok = {"prompt": [5, 6, 7], "max_tokens": 1, "ignore_eos": True, "temperature": 0}
        sends = {
            ("http", "length"): lambda: call(http + "/v1/completions", ok) == 200,
            ("http", "invalid_argument"): lambda: (call(http + "/v1/completions", {**ok, "max_tokens": "x"}) == 400
                                                   and call(http + "/v1/completions", {**ok, "top_p": 5}) == 400),
            ("http", "unauthenticated"): lambda: call(http + "/v1/completions", ok, key="wrong") == 401,
            ("http", "not_found"): lambda: (call(http + "/v1/nothing", ok) == 404 and call(http + "/nothing") == 404
                                            and call(http + "/v1/completions", {**ok, "model": "other"}) == 404),
            ("http", "too_large"): lambda: call(http + "/v1/completions", raw=b" " * (2 << 20)) == 413,
        }
        per_send = {("http", "invalid_argument"): 2, ("http", "not_found"): 3}
        for label, send in sends.items():
            for _ in range(N):
                assert send(), label
        with client_for(srv) as c:
            for _ in range(N):
                assert len([t for ch in c.generate([5, 6, 7], max_tokens=1, temperature=0.0, ignore_eos=True)
                            for t in ch.token_ids]) == 1
                with pytest.raises(PagedServeError) as err:
                    c.generate_text([5, 6, 7], top_p=5.0)
                assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            for _ in range(N):  # what is not counted: probes, scrapes, successes that generate nothing
                assert call(http + "/health") == 200 and call(http + "/v1/models") == 200
                assert call(http + "/tokenize", {"prompt": "hi"}) == 200
        expected = {label: N * per_send.get(label, 1) for label in sends}
        expected.update({("grpc", "length"): N, ("grpc", "invalid_argument"): N})
        assert moved(before, scrape()) == expected
    finally:
        assert srv.stop() == 0, srv.log()


class _Info:
    max_model_len = 64


class _FullEngine:
    """Just enough of AsyncEngine for a request to reach the queue, which is full."""

    max_waiting_requests = 4
    vocab_size = 100
    lora_enabled = False

    def model_info(self):
        return _Info()

    async def generate(self, *args, **kwargs):
        raise QueueFullError("the queue is full (max_waiting_requests 4)")
        yield  # an async generator, as the engine's


def test_full_queue_and_loading_are_counted_in_process():
    from pagedserve.sidecar.http_api import HttpApi, HttpServer

    state: dict = {"engine": None}
    metrics = ServerMetrics(lambda: None)

    async def main() -> list[int]:
        api = HttpApi(lambda: state["engine"], lambda: "m", lambda: True, 100, 4, metrics=metrics)
        server = HttpServer(api.app(), "127.0.0.1", 0)
        server.start()
        try:
            url = server.address + "/v1/completions"
            statuses = [await asyncio.to_thread(call, url, {"prompt": [1, 2]}, None, None) for _ in range(N)]
            state["engine"] = _FullEngine()
            statuses += [await asyncio.to_thread(call, url, {"prompt": [1, 2], "max_tokens": 2}, None, None)
                         for _ in range(N)]
        finally:
            await server.stop()
        return statuses

    before = counts(_text(metrics))
    assert asyncio.run(main()) == [503] * N + [429] * N
    assert moved(before, counts(_text(metrics))) == {("http", "unavailable"): N, ("http", "resource_exhausted"): N}


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self) -> None:
        self.codes: list[grpc.StatusCode] = []

    async def abort(self, code, message):
        self.codes.append(code)
        raise _Aborted(message)

    async def send_initial_metadata(self, metadata):
        pass

    async def write(self, message):
        pass


def test_grpc_refusals_before_and_at_the_engine_are_counted():
    from pagedserve.sidecar.pb import generation_pb2 as pb
    from pagedserve.sidecar.servicer import GenerationServicer

    state: dict = {"engine": None}
    metrics = ServerMetrics(lambda: None)
    servicer = GenerationServicer(lambda: state["engine"], lambda: "m", 100, metrics=metrics)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(max_tokens=2))

    async def send() -> list[grpc.StatusCode]:
        ctx = _Context()
        with pytest.raises(_Aborted):
            await servicer.Generate(request, ctx)
        return ctx.codes

    before = counts(_text(metrics))
    codes = [c for _ in range(N) for c in asyncio.run(send())]  # still loading: no engine yet
    state["engine"] = _FullEngine()
    codes += [c for _ in range(N) for c in asyncio.run(send())]
    assert codes == [grpc.StatusCode.UNAVAILABLE] * N + [grpc.StatusCode.RESOURCE_EXHAUSTED] * N
    assert moved(before, counts(_text(metrics))) == {("grpc", "unavailable"): N, ("grpc", "resource_exhausted"): N}


def _text(metrics: ServerMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()
