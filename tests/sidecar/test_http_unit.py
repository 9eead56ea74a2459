"""The HTTP app in-process, on uvicorn in this test's event loop, with no engine behind it: 503 while the model
loads and while the server drains, /health likewise, /metrics 404 when metrics are off."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from pagedserve.sidecar.http_api import HttpApi, HttpServer


def call(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_loading_and_draining_answer_503():
    state = {"engine": None, "serving": False}

    async def main() -> list[tuple[str, int, dict]]:
        api = HttpApi(lambda: state["engine"], lambda: "m", lambda: state["serving"], 100, 4)
        server = HttpServer(api.app(), "127.0.0.1", 0)
        server.start()
        seen = []
        try:
            for phase in ("loading", "draining"):
                if phase == "draining":
                    state["engine"] = object()  # loaded, but no longer serving: nothing of it is touched
                for path, body in [("/health", None), ("/v1/models", None), ("/v1/completions", {"prompt": "hi"}),
                                   ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                   ("/tokenize", {"prompt": "hi"})]:
                    status, answer = await asyncio.to_thread(call, server.address + path, body)
                    seen.append((phase, path, status, answer["error"]["code"]))
            seen.append(("metrics", "/metrics", *(await asyncio.to_thread(call, server.address + "/metrics"))[:1],
                         None))
        finally:
            await server.stop()
        return seen

    seen = asyncio.run(main())
    for phase, path, status, code in seen[:-1]:
        assert status == 503, (phase, path, status)
        assert code == ("not_serving" if path == "/health" else phase), (phase, path, code)
    assert seen[-1][2] == 404


def test_outputs_merge_prompts_in_order_and_pull_no_further_than_the_reader():
    from pagedserve.sidecar.http_outputs import Outputs

    pulled: list[tuple[int, int]] = []
    closed: set[int] = set()

    async def gen(p: int, n: int):
        try:
            for i in range(n):
                pulled.append((p, i))
                yield (p, i)
        finally:
            closed.add(p)

    async def main():
        outs = Outputs([gen(0, 500), gen(1, 500)])
        await outs.prime()
        for _ in range(100):  # let the pumps run as far as they may (a bounded loop of yields, no waiting)
            await asyncio.sleep(0)
        assert sorted(pulled) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # Outputs.AHEAD each, then they wait
        got = [item async for _, item in outs]
        assert [i for p, i in got if p == 0] == list(range(500)) and [i for p, i in got if p == 1] == list(range(500))
        assert outs.last == [(0, 499), (1, 499)]
        await outs.aclose()
        # A reader that leaves early: every generator is closed (the engine's aborts its request).
        early = Outputs([gen(2, 10**6), gen(3, 10**6)])
        await early.prime()
        await early.__anext__()
        await early.aclose()
        assert {2, 3} <= closed

    asyncio.run(main())
