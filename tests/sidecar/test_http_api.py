"""The OpenAI-compatible HTTP API end to end: a real `pagedserve serve --http-port 0 --api-key KEY` process on
the tiny model, spoken to with the official `openai` client (and plain HTTP where the client hides the wire),
beside its gRPC socket on the same engine."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
import socket
import urllib.error
import urllib.request

import openai
import pytest
from engine_helpers import wait_until
from http_helpers import grpc_greedy_ids, http_address, recording_openai, send
from server_proc import ServerProcess, client_for, wait_idle

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("http"), "--max-model-len", "512", "--max-prompt-chars", "2000",
                        "--max-chat-messages", "8", "--http-port", "0", "--api-key", KEY)
    srv.wait_serving()
    srv.http = http_address(srv)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def oai(server):
    with recording_openai(server.http + "/v1", KEY, max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def raw(server, method: str, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
    return send(server.http + path, body, method=method, headers={"Authorization": f"Bearer {key}"} if key else None)


def test_models_and_health(server, oai, model):
    with client_for(server) as c:
        info = c.model_info()
    models = oai.models.list().data
    assert [m.id for m in models] == [model] and model
    assert models[0].model_extra["max_model_len"] == info.max_model_len == 512
    assert oai.models.retrieve(model).id == model
    assert raw(server, "GET", "/health", key=None) == (200, {"status": "ok"})  # open without the key


def test_greedy_completion_equals_grpc_token_for_token(server, oai, model):
    prompt = [3 + (j * 7) % 500 for j in range(20)]
    ref = grpc_greedy_ids(server, prompt, 24)
    extra = {"ignore_eos": True, "return_token_ids": True}
    whole = oai.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, extra_body=extra)
    choice = whole.choices[0]
    assert choice.model_extra["token_ids"] == ref and choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == 20 and whole.usage.completion_tokens == 24 and whole.object == "text_completion"
    chunks = list(oai.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body=extra))
    assert [t for ch in chunks for c in ch.choices for t in c.model_extra["token_ids"]] == ref
    assert "".join(c.text for ch in chunks for c in ch.choices) == choice.text
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_chat_whole_and_streaming_agree(server, oai, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    whole = oai.chat.completions.create(model=model, messages=messages, max_completion_tokens=12, temperature=0,
                                        user="someone", extra_body={"ignore_eos": True})
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    stream = oai.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for ch in chunks for c in ch.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 0
    with client_for(server) as c:  # the same conversation over gRPC: the same reply
        grpc_text = c.chat_text(messages, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert grpc_text == whole.choices[0].message.content


def test_n2_and_seeded_sampling_reproduces(oai, model):
    kw = dict(model=model, prompt="Once upon a time", n=2, max_tokens=16, temperature=0.9, top_p=0.95,
              presence_penalty=0.3, frequency_penalty=0.2, extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    first = oai.completions.create(seed=7, **kw)
    again = oai.completions.create(seed=7, **kw)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 32
    chunks = list(oai.completions.create(seed=7, stream=True, **kw))
    texts = {i: "".join(c.text for ch in chunks for c in ch.choices if c.index == i) for i in (0, 1)}
    assert [texts[0], texts[1]] == [c.text for c in first.choices]


def test_stop_string_ends_with_stop(oai, model):
    kw = dict(model=model, prompt=[5, 6, 7, 8], max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    text = oai.completions.create(**kw).choices[0].text
    at = next((i for i in range(2, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].strip()), None)
    assert at is not None, f"no ASCII pair to stop on in {text!r}"
    stop = text[at:at + 2]
    got = oai.completions.create(stop=[stop], **kw).choices[0]
    assert got.finish_reason == "stop" and got.text == text[:text.index(stop)]


def test_errors_in_openai_shape(server, oai, model):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt="hi", temperature=-1)
    assert err.value.status_code == 400 and err.value.param == "temperature" and "temperature" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt="x" * 2001)
    assert err.value.param == "prompt" and "2001 characters; the limit is 2000" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}] * 9)
    assert err.value.param == "messages" and "the limit is 8" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=0)
    assert err.value.param == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt="hi", suffix="!")
    assert err.value.param == "suffix" and "not supported" in err.value.message
    with pytest.raises(openai.NotFoundError) as err:
        oai.completions.create(model="gpt-4o", prompt="hi")
    assert err.value.code == "model_not_found" and err.value.param == "model"
    with openai.OpenAI(base_url=server.http + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    status, body = raw(server, "POST", "/v1/completions", {"prompt": "hi", "n": "two"})
    assert status == 400 and body["error"]["param"] == "n" and body["error"]["type"] == "invalid_request_error"
    status, body = raw(server, "POST", "/v1/completions", {"prompt": [5, 9999]})
    assert status == 400 and "[0, 512)" in body["error"]["message"]
    status, body = raw(server, "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
    assert status == 400 and body["error"]["param"] == "messages[0].role"
    for path, body, param in [("/v1/completions", {"prompt": "a\ud800"}, "prompt"),  # a lone surrogate: no 500
                              ("/v1/completions", {"prompt": "a", "stop": ["\udfff"]}, "stop[0]"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
                               "messages[0].content")]:
        status, err_body = raw(server, "POST", path, body)
        assert status == 400 and err_body["error"]["param"] == param, err_body
    assert raw(server, "GET", "/v1/no-such-route")[0] == 404
    assert raw(server, "POST", "/v1/completions", {"prompt": "hi"}, key=None)[0] == 401
    with client_for(server) as c:
        assert wait_idle(c).kv_blocks_used == 0


def test_a_disconnect_mid_stream_frees_the_blocks(server, oai, model):
    with client_for(server) as c:
        stream = oai.completions.create(model=model, prompt=[5, 6, 7], max_tokens=480, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        stats = wait_idle(c)
        assert stats.kv_blocks_used == 0 and stats.num_running == 0
        # A whole-answer request whose client leaves: aborted too, once the server sees the socket close.
        host, port = server.http.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"prompt": [5, 6, 8], "max_tokens": 480, "ignore_eos": True}).encode()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            wait_until(lambda: c.server_stats().num_running > 0, 30, "the request to run")
        stats = wait_idle(c)
        assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
        # Both were aborted, not left to run to their 480 tokens.
        aborted = [json.loads(line) for line in server.log().splitlines() if '"request.aborted"' in line]
        assert len([e for e in aborted if e.get("request_id", "").startswith("cmpl-")]) == 2, aborted
        assert grpc_greedy_ids(server, [5, 6, 7], 3)  # still serving


def test_a_full_queue_answers_429(tmp_path):
    """One running seat and two waiting places: once a long request runs, 7 more at once find the queue full
    (how many exactly depends on whether the first has finished meanwhile); each accepted one completes."""
    srv = ServerProcess(tmp_path, "--max-num-seqs", "1", "--max-waiting-requests", "2", "--http-port", "0")
    try:
        srv.wait_serving()
        srv.http = http_address(srv)
        body = {"prompt": [5, 6, 4], "max_tokens": 480, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(srv.http + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as first:
            assert first.readline().startswith(b"data: ")  # running: it has a token
            with ThreadPoolExecutor(7) as pool:
                outcomes = list(pool.map(lambda i: raw(srv, "POST", "/v1/completions", {
                    "prompt": [5, 6, 7 + i], "max_tokens": 480, "ignore_eos": True}, key=None), range(7)))
        refused = [b for status, b in outcomes if status == 429]
        assert refused and all(b["error"]["code"] == "queue_full" and "max_waiting_requests=2" in b["error"]["message"]
                               for b in refused), outcomes
        assert all(b["choices"][0]["finish_reason"] == "length" for status, b in outcomes if status == 200), outcomes
        assert len(refused) + sum(status == 200 for status, _ in outcomes) == 7
    finally:
        assert srv.stop() == 0, srv.log()


def test_sigterm_drains_http_streams_and_refuses_new_requests_with_503(tmp_path):
    srv = ServerProcess(tmp_path, "--max-num-seqs", "1", "--drain-timeout", "60", "--http-port", "0")
    srv.wait_serving()
    srv.http = http_address(srv)

    def stream(i: int) -> list[str]:
        body = {"prompt": [5, 6, 7 + i], "max_tokens": 480, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(srv.http + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return [line.decode().strip() for line in resp if line.strip()]

    try:
        with ThreadPoolExecutor(12) as pool:  # ~12 x 480 tokens one at a time: seconds of work queued
            futures = [pool.submit(stream, i) for i in range(12)]
            with client_for(srv) as c:
                wait_until(lambda: c.server_stats().num_waiting >= 6, 30, "the streams to queue")
            srv.proc.terminate()
            wait_until(lambda: raw(srv, "GET", "/health", key=None)[0] == 503, 30, "health to answer 503")
            status, body = raw(srv, "POST", "/v1/completions", {"prompt": "hi"}, key=None)
            assert status == 503 and body["error"]["code"] == "draining", body
            results = [f.result(timeout=120) for f in futures]
        for lines in results:  # every admitted stream ran to its end within the drain
            assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2], lines[-3:]
        assert srv.proc.wait(60) == 0, srv.log()
    finally:
        srv.stop()


def test_http_settings():
    from pagedserve.sidecar.settings import load_settings

    s = load_settings(None, {})
    assert (s.http_port, s.http_host, s.api_key) == (None, "127.0.0.1", None)  # off unless asked for
    s = load_settings(None, {"PAGEDSERVE_HTTP_PORT": "8000", "PAGEDSERVE_API_KEY": "k"})
    assert (s.http_port, s.api_key) == (8000, "k")
    for env, needle in [({"PAGEDSERVE_HTTP_PORT": "70000"}, "http_port must be in [0, 65535]"),
                        ({"PAGEDSERVE_API_KEY": " "}, "api_key is empty")]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            load_settings(None, env)


def test_no_max_tokens_means_the_rest_of_the_context(server, model):
    status, body = raw(server, "POST", "/v1/completions", {"model": model, "prompt": "hello there", "max_tokens": None,
                                                           "ignore_eos": True, "temperature": 0})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 512
