"""SIGTERM drains HTTP requests as it drains gRPC ones, in one window: what finishes within --drain-timeout
ends normally, the rest ends cleanly (an SSE stream with OpenAI's error event, a whole answer with 503, a
gRPC stream with UNAVAILABLE), neither an idle keep-alive connection nor a client that stopped reading holds
the exit up, and the process exits 0. (tests/sidecar/test_http_api.py checks that streams queued at SIGTERM
all finish within a long window and that new requests get 503.)

On the tiny model one sequence decodes at most ~1000 tokens/s and eight ~300 steps/s: the short streams
(100 tokens) end well inside the 1.5 s window, and the long ones (2000 tokens) cannot finish in it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time

import openai
import pytest
from server_proc import ServerProcess, client_for

from pagedserve.sidecar.client import PagedServeError

DRAIN_S = 1.5
SHORT, LONG = 100, 2000


def http_address(srv: ServerProcess) -> str:
    for line in srv.log().splitlines():
        if '"server.listening"' in line:
            return next(a for a in json.loads(line)["addresses"] if a.startswith("http://"))
    raise AssertionError(f"no server.listening line:\n{srv.log()}")


def stalled_stream(host: str, port: int) -> socket.socket:
    """A long stream (logprobs make its events large) asked for on a socket with a tiny receive buffer, then
    never read: the server's writes back up, and the drain must not wait on them for ever."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.settimeout(30)
    s.connect((host, port))
    body = json.dumps({"prompt": [8, 8, 8], "max_tokens": LONG, "ignore_eos": True, "stream": True,
                       "logprobs": 5}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


def read_to_end(s: socket.socket, limit: int = 64 << 20) -> bytes:
    """Everything until the peer closes (bounded: a stream of LONG tokens is far below `limit`)."""
    data = b""
    while len(data) < limit:
        got = s.recv(1 << 16)
        if not got:
            break
        data += got
    s.close()
    return data


@pytest.mark.slow
def test_sigterm_finishes_or_cleanly_ends_http_and_grpc_streams_then_exits_zero(tmp_path):
    srv = ServerProcess(tmp_path, "--drain-timeout", str(DRAIN_S), "--http-port", "0")
    outcomes: dict[str, str] = {}
    lock = threading.Lock()
    started = threading.Barrier(8, timeout=60)  # the 7 streams + the test

    def record(name: str, result: str) -> None:
        with lock:
            outcomes[name] = result

    def http_stream(name: str, max_tokens: int, oai: openai.OpenAI) -> None:
        try:
            stream = oai.completions.create(model=model, prompt=[5, 6, 7 + len(name)], max_tokens=max_tokens,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
            text_chunks, finish = 0, None
            for chunk in stream:
                if text_chunks == 0:
                    started.wait()
                text_chunks += 1
                finish = chunk.choices[0].finish_reason or finish
            record(name, f"finished:{finish}")
        except openai.APIError as e:  # the stream's last event was an error object
            record(name, f"error:{getattr(e, 'code', None)}:{e.message}")

    def http_whole(name: str, oai: openai.OpenAI) -> None:
        try:
            r = oai.completions.create(model=model, prompt=[9, 9, 9], max_tokens=LONG, temperature=0,
                                       extra_body={"ignore_eos": True})
            record(name, f"finished:{r.choices[0].finish_reason}")
        except openai.APIStatusError as e:
            record(name, f"status:{e.status_code}:{e.body.get('code') if isinstance(e.body, dict) else e.body}")

    def grpc_stream(name: str, max_tokens: int) -> None:
        with client_for(srv) as c:
            s = c.generate([5, 6, 7, len(name)], max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            try:
                next(s)
                started.wait()
                chunks = list(s)
                record(name, "finished:" + (chunks[-1].finish_reason if chunks else "?"))
            except PagedServeError as e:
                record(name, f"error:{e.code.name}:{e.message}")

    try:
        srv.wait_serving()
        srv.http = http_address(srv)
        host, port = srv.http.removeprefix("http://").rsplit(":", 1)
        with openai.OpenAI(base_url=srv.http + "/v1", api_key="none", max_retries=0, timeout=120) as oai:
            model = oai.models.list().data[0].id  # leaves a keep-alive connection in the client's pool
            idle = socket.create_connection((host, int(port)), timeout=30)  # connected, never sends a byte
            stalled = stalled_stream(host, int(port))  # a stream whose client stopped reading
            # A whole answer sends nothing before it ends: start it first, alone, and see it run in the stats.
            threads = [threading.Thread(target=http_whole, args=("http-whole-long", oai))]
            threads[0].start()
            with client_for(srv) as c:
                deadline = time.monotonic() + 60
                while c.server_stats().num_running < 1:
                    assert time.monotonic() < deadline, "the whole-answer request never ran"
                    time.sleep(0.002)
            threads += [threading.Thread(target=http_stream, args=(f"http-short-{i}", SHORT, oai)) for i in range(3)]
            threads += [threading.Thread(target=http_stream, args=(f"http-long-{i}", LONG, oai)) for i in range(2)]
            threads += [threading.Thread(target=grpc_stream, args=("grpc-short", SHORT)),
                        threading.Thread(target=grpc_stream, args=("grpc-long", LONG))]
            for t in threads[1:]:
                t.start()
            started.wait()  # every request is running
            srv.proc.terminate()
            t_term = time.monotonic()
            for t in threads:
                t.join(120)
            try:
                code = srv.proc.wait(60)
            except subprocess.TimeoutExpired:
                srv.proc.send_signal(signal.SIGABRT)  # faulthandler dumps every thread into the log
                srv.proc.wait(10)
                raise AssertionError(f"no exit after SIGTERM:\n{srv.log()[-20000:]}")
            exit_s = time.monotonic() - t_term
            assert idle.recv(1) == b""  # the server closed the idle connection on its way out
            idle.close()
            assert read_to_end(stalled).startswith(b"HTTP/1.1 200")  # it got its headers, then the server left
    finally:
        srv.stop()
    assert code == 0, srv.log()
    assert sorted(outcomes) == sorted(["grpc-long", "grpc-short", "http-whole-long"] +
                                      [f"http-short-{i}" for i in range(3)] + [f"http-long-{i}" for i in range(2)])
    for name, result in outcomes.items():
        if "short" in name:  # in flight at SIGTERM, finished inside the window
            assert result == "finished:length", (name, result)
        elif name.startswith("http-long"):  # the SSE stream's last event: OpenAI's error object, then the end
            assert result.startswith("error:unavailable:server shutting down") and "drain timeout" in result, result
        elif name == "grpc-long":
            assert result.startswith("error:UNAVAILABLE") and "drain timeout" in result, result
        else:
            assert result == "status:503:unavailable", result
    # Aborted at the window's end; the rest of the shutdown (gRPC grace, uvicorn) takes seconds at most.
    assert DRAIN_S - 0.5 < exit_s < DRAIN_S + 10, exit_s
    stopped = [json.loads(line) for line in srv.log().splitlines() if '"server.stopped"' in line]
    assert len(stopped) == 1 and stopped[0]["aborted"] == 5, stopped  # the four long ones and the stalled one
