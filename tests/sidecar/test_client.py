"""PagedServeClient and AsyncPagedServeClient against an in-process gRPC server with a fake servicer.

The fake answers with canned behaviour keyed by the prompt text:
  "fail"      -> INVALID_ARGUMENT before any chunk
  "fail-late" -> one chunk, then INTERNAL
  "slow"      -> a chunk every 20 ms for 10 s (to test cancel-on-break and deadlines)
  anything    -> per sample, 3 chunks echoing the prompt's first 3 tokens, then one Usage
Token ids of a text are its characters' code points.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine_helpers import wait_until

from pagedserve.sidecar import client as client_mod
from pagedserve.sidecar.client import (AsyncPagedServeClient, GenerationChunk, PagedServeClient, PagedServeError,
                                       resolve_target)
from pagedserve.sidecar.pb import generation_pb2 as pb
from pagedserve.sidecar.pb import generation_pb2_grpc as pb_grpc

SLOW_CHUNK_S = 0.02
SLOW_CHUNKS = 500  # 10 s if nobody cancels


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


class FakeGeneration(pb_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.slow_ended = threading.Event()
        self.slow_chunks_sent = 0

    def Generate(self, request, context):
        self.requests.append(request)
        s = request.sampling
        if s.HasField("temperature") and s.temperature < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"temperature must be non-negative (>= 0), got {s.temperature}.")
        which = request.WhichOneof("prompt")
        if which is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt must be set")
        text = request.text if which == "text" else ""
        if text == "fail":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        if text == "slow":
            yield from self._slow(context)
            return
        if which == "token_ids":
            ids = list(request.token_ids.ids)
        elif which == "chat":
            ids = _ids("".join(f"<{m.role}>{m.content}" for m in request.chat.messages))
        else:
            ids = _ids(text)
        n = s.n if s.HasField("n") else 1
        for index in range(n):
            for k in range(3):
                tok = ids[k % len(ids)]
                chunk = pb.Chunk(index=index, text=chr(tok) if tok < 0x110000 else "?", token_ids=[tok])
                if s.HasField("logprobs"):
                    chunk.logprobs.add(token_id=tok, logprob=-0.5,
                                       top_logprobs=[pb.TopLogprob(token_id=t, logprob=-1.0 * (t + 1))
                                                     for t in range(s.logprobs)])
                if k == 2:
                    if s.stop:
                        chunk.finish_reason, chunk.stop_str = "stop", s.stop[0]
                    elif s.stop_token_ids:
                        chunk.finish_reason, chunk.stop_token_id = "stop", s.stop_token_ids[0]
                    else:
                        chunk.finish_reason = "length"
                yield pb.GenerateResponse(chunk=chunk)
            if text == "fail-late":
                context.abort(grpc.StatusCode.INTERNAL, "the engine fell over")
        yield pb.GenerateResponse(usage=pb.Usage(
            request_id=request.request_id or "srv-1", prompt_tokens=len(ids), completion_tokens=3 * n,
            cached_tokens=1, queue_time_s=0.25, ttft_s=0.5, e2e_s=1.5))

    def _slow(self, context):
        context.add_callback(self.slow_ended.set)  # runs when the RPC ends, whatever the reason
        for i in range(SLOW_CHUNKS):
            time.sleep(SLOW_CHUNK_S)
            if not context.is_active():
                return
            self.slow_chunks_sent += 1
            yield pb.GenerateResponse(chunk=pb.Chunk(index=0, text=".", token_ids=[46]))

    def Tokenize(self, request, context):
        if request.WhichOneof("input") == "chat":
            m = request.chat
            text = "".join(f"<{x.role}>{x.content}" for x in m.messages)
            if not m.HasField("add_generation_prompt") or m.add_generation_prompt:
                text += "<assistant>"
        else:
            text = request.text
        ids = _ids(text)
        if request.add_special_tokens if request.HasField("add_special_tokens") else request.HasField("text"):
            ids = [1] + ids
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    def Detokenize(self, request, context):
        bad = [t for t in request.token_ids if not 0 <= t < 0x110000]
        if bad:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token ids must be in [0, 1114112); got {bad}")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text="".join(chr(t) for t in request.token_ids if not (skip and t == 1)))

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(name="fake", architecture="LlamaForCausalLM", max_model_len=2048, vocab_size=49152,
                            block_size=16, dtype="float32", backend="numpy", num_kv_blocks=512, kernels="numba",
                            blas_kernel="SkylakeX", blas_threads=2, numba_code_path="avx2")

    def GetServerStats(self, request, context):
        return pb.ServerStats(num_running=2, num_waiting=1, kv_blocks_used=10, kv_blocks_total=512,
                              kv_utilization=0.75, prefix_cache_hit_rate=0.5, output_tokens_per_s=12.5,
                              total_tokens_per_s=100.0, num_preemptions=3, uptime_s=42.0)

    def Abort(self, request, context):
        return pb.AbortResponse(found=request.request_id == "running-1")


@pytest.fixture(scope="module")
def server():
    # A short directory: unix socket paths are limited to about 107 bytes, pytest's tmp_path is long.
    tmp = tempfile.mkdtemp(prefix="ps-client-")
    sock = f"{tmp}/s.sock"
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    fake = FakeGeneration()
    pb_grpc.add_GenerationServicer_to_server(fake, srv)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, srv)
    assert srv.add_insecure_port(f"unix:{sock}") != 0
    srv.start()
    yield sock, fake, health_servicer
    srv.stop(grace=None)
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def client(server):
    with PagedServeClient(server[0]) as c:
        yield c


# -- targets --------------------------------------------------------------------------------------


def test_resolve_target(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_SOCKET", raising=False)
    assert resolve_target() == "unix:/run/pagedserve/pagedserve.sock"
    monkeypatch.setenv("PAGEDSERVE_SOCKET", "/tmp/x/p.sock")
    assert resolve_target() == "unix:/tmp/x/p.sock"
    assert resolve_target("/srv/a.sock") == "unix:/srv/a.sock"  # an explicit target beats the env var
    assert resolve_target("unix:///srv/a.sock") == "unix:///srv/a.sock"
    assert resolve_target("127.0.0.1:50051") == "127.0.0.1:50051"
    assert resolve_target("localhost:50051") == "localhost:50051"
    assert resolve_target("rel.sock").startswith("unix:/") and resolve_target("rel.sock").endswith("/rel.sock")
    with pytest.raises(ValueError):
        resolve_target("")


def test_env_var_is_the_default_target(server, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_SOCKET", server[0])
    with PagedServeClient() as c:
        assert c.target == f"unix:{server[0]}"
        assert c.health() == "SERVING"


# -- generation (sync) ----------------------------------------------------------------------------


def test_generate_streams_chunks_then_usage(client, server):
    stream = client.generate("Hello", max_tokens=3, request_id="mine")
    assert stream.usage is None
    chunks = list(stream)
    assert [c.text for c in chunks] == ["H", "e", "l"]
    assert [c.token_ids for c in chunks] == [[72], [101], [108]]
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert [c.finished for c in chunks] == [False, False, True]
    assert all(c.index == 0 and c.logprobs is None and c.stop_reason is None for c in chunks)
    assert stream.usage == client_mod.Usage(request_id="mine", prompt_tokens=5, completion_tokens=3,
                                            cached_tokens=1, queue_time_s=0.25, ttft_s=0.5, e2e_s=1.5)
    assert stream.request_id == "mine"
    assert list(stream) == []  # exhausted stays exhausted


def test_server_assigned_request_id_is_reported(client):
    stream = client.generate("abc")
    assert stream.request_id is None
    list(stream)
    assert stream.request_id == "srv-1"


def test_sampling_kwargs_keep_presence(client, server):
    fake = server[1]
    list(client.generate([5, 6, 7], temperature=0.0, top_k=-1, seed=7, stop="END", stop_token_ids=[2],
                         skip_special_tokens=False, ignore_eos=None))
    req = fake.requests[-1]
    assert req.WhichOneof("prompt") == "token_ids" and list(req.token_ids.ids) == [5, 6, 7]
    s = req.sampling
    # temperature=0 and skip_special_tokens=False are sent (presence), not mistaken for "unset"
    assert s.HasField("temperature") and s.temperature == 0.0
    assert s.HasField("skip_special_tokens") and s.skip_special_tokens is False
    assert s.top_k == -1 and s.seed == 7 and list(s.stop) == ["END"] and list(s.stop_token_ids) == [2]
    # omitted or None: unset, so the server applies its own default
    for name in ("n", "top_p", "max_tokens", "ignore_eos", "logprobs", "best_of"):
        assert not s.HasField(name), name


def test_logit_bias_goes_over_the_wire_and_is_checked_by_the_server():
    from pagedserve.sidecar.servicer import sampling_params_from_proto

    msg = client_mod._sampling("generate", {"logit_bias": {77: 100, 3: -2.5}})[0]
    assert dict(msg.logit_bias) == {77: 100.0, 3: -2.5}
    assert sampling_params_from_proto(msg).logit_bias == {77: 100.0, 3: -2.5}
    assert sampling_params_from_proto(pb.SamplingParams()).logit_bias is None  # unset: none
    with pytest.raises(ValueError, match=r"logit_bias\[77\] must be in \[-100, 100\], got 101.0"):
        sampling_params_from_proto(pb.SamplingParams(logit_bias={77: 101}))
    with pytest.raises(ValueError, match="logit_bias keys must be non-negative token ids, got -1"):
        sampling_params_from_proto(pb.SamplingParams(logit_bias={-1: 1}))


def test_every_runtime_sampling_param_is_a_kwarg():
    from pagedserve.runtime.sampling_params import SamplingParams

    assert {f.name for f in dataclasses.fields(SamplingParams)} <= client_mod.SAMPLING_FIELDS


def test_unknown_kwarg_raises_type_error_before_sending(client, server):
    before = len(server[1].requests)
    with pytest.raises(TypeError, match="'temprature'"):
        client.generate("x", temprature=0.5)
    with pytest.raises(TypeError, match="'beam_width'"):
        client.chat([{"role": "user", "content": "x"}], beam_width=4)
    with pytest.raises(TypeError):
        client.generate(b"bytes are not a prompt")
    with pytest.raises(TypeError):
        client.generate([1, 2.5])  # a float is not a token id
    assert len(server[1].requests) == before


def test_stop_reasons_and_logprobs(client):
    chunks = list(client.generate("abc", stop=["c"], logprobs=2))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == "c"
    lp = chunks[0].logprobs
    assert lp is not None and len(lp) == 1
    assert lp[0].token_id == 97 and lp[0].logprob == pytest.approx(-0.5)
    assert [(t.token_id, t.logprob) for t in lp[0].top_logprobs] == [(0, -1.0), (1, -2.0)]
    chunks = list(client.generate("abc", stop_token_ids=[99]))
    assert chunks[-1].stop_reason == 99 and chunks[-1].logprobs is None
    # logprobs=0 asks for the chosen token's logprob only: a list, not None
    assert list(client.generate("abc", logprobs=0))[0].logprobs[0].top_logprobs == []


def test_generate_text_rule(client):
    assert client.generate_text("Hello") == "Hel"
    assert client.generate_text("Hello", n=1) == "Hel"
    assert client.generate_text("Hello", n=3, temperature=1.0) == ["Hel", "Hel", "Hel"]


def test_chat(client, server):
    msgs = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    chunks = list(client.chat(msgs, max_tokens=3))
    assert "".join(c.text for c in chunks) == "<sy"
    req = server[1].requests[-1]
    assert req.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "Be brief"), ("user", "Hi")]
    assert req.chat.HasField("add_generation_prompt") and req.chat.add_generation_prompt
    assert client.chat_text(msgs, add_generation_prompt=False) == "<sy"
    assert server[1].requests[-1].chat.add_generation_prompt is False
    with pytest.raises(TypeError, match=r"messages\[0\]"):
        client.chat([{"role": "user"}])


def test_invalid_argument_is_a_pagedserve_error(client):
    with pytest.raises(PagedServeError) as info:
        list(client.generate("hi", temperature=-1.0))
    err = info.value
    assert not isinstance(err, grpc.RpcError)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message == "temperature must be non-negative (>= 0), got -1.0."
    assert "INVALID_ARGUMENT" in str(err)
    with pytest.raises(PagedServeError) as info:
        client.generate_text("fail")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.message == "prompt is empty"


def test_error_mid_stream(client):
    stream = client.generate("fail-late")
    first = next(stream)
    assert first.text == "f"
    with pytest.raises(PagedServeError) as info:
        list(stream)
    assert info.value.code == grpc.StatusCode.INTERNAL and stream.usage is None


def test_breaking_off_a_stream_cancels_the_rpc(client, server):
    fake = server[1]
    fake.slow_ended.clear()
    for chunk in client.generate("slow"):
        assert chunk.text == "."
        break  # the stream object is dropped here
    assert fake.slow_ended.wait(2.0), "the server never saw the RPC end"
    # and close() on a stream held in a variable does the same
    fake.slow_ended.clear()
    stream = client.generate("slow")
    next(stream)
    stream.close()
    assert fake.slow_ended.wait(2.0)
    assert list(stream) == []
    # leaving a with block early too
    fake.slow_ended.clear()
    with client.generate("slow") as stream:
        next(stream)
    assert fake.slow_ended.wait(2.0)


def test_deadline_and_per_call_timeout(server):
    fake = server[1]
    with PagedServeClient(server[0], generate_timeout=0.2) as c:
        fake.slow_ended.clear()
        t0 = time.monotonic()
        with pytest.raises(PagedServeError) as info:
            list(c.generate("slow"))
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 2.0
        assert fake.slow_ended.wait(2.0)
        # a per-call timeout overrides the client's default
        sent = fake.slow_chunks_sent
        t_call = time.monotonic()
        stream = c.generate("slow", timeout=5.0)
        # the server streams on past the client's 0.2 s default (a chunk every 20 ms)
        wait_until(lambda: fake.slow_chunks_sent - sent >= 20 and time.monotonic() - t_call > 0.4, 5.0,
                   "the slow stream to outlive the client's default deadline")
        assert next(stream).text == "."
        stream.close()


def test_unreachable_server_is_unavailable(tmp_path):
    with PagedServeClient(tmp_path / "nobody.sock", timeout=2.0) as c:
        with pytest.raises(PagedServeError) as info:
            c.model_info()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(PagedServeError) as info:
            list(c.generate("x"))
        assert info.value.code == grpc.StatusCode.UNAVAILABLE


# -- the small calls (sync) -----------------------------------------------------------------------


def test_tokenize_detokenize(client):
    assert client.tokenize("ab") == [1, 97, 98]
    assert client.tokenize("ab", add_special_tokens=False) == [97, 98]
    assert client.tokenize([{"role": "user", "content": "x"}]) == _ids("<user>x<assistant>")
    assert client.tokenize([{"role": "user", "content": "x"}], add_generation_prompt=False) == _ids("<user>x")
    assert client.detokenize([1, 104, 105]) == "hi"
    assert client.detokenize((1, 104, 105), skip_special_tokens=False) == "\x01hi"
    with pytest.raises(PagedServeError) as info:
        client.detokenize([-3])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "[-3]" in info.value.message


def test_model_info_server_stats_abort(client):
    info = client.model_info()
    assert info == client_mod.ModelInfo(name="fake", architecture="LlamaForCausalLM", max_model_len=2048,
                                        vocab_size=49152, block_size=16, dtype="float32", backend="numpy",
                                        num_kv_blocks=512, kernels="numba", blas_kernel="SkylakeX", blas_threads=2,
                                        numba_code_path="avx2")
    stats = client.server_stats()
    assert (stats.num_running, stats.kv_blocks_total, stats.num_preemptions) == (2, 512, 3)
    assert stats.kv_utilization == 0.75 and stats.uptime_s == 42.0
    assert client.abort("running-1") is True
    assert client.abort("nope") is False


def test_dataclasses_mirror_the_messages():
    for cls, msg in ((client_mod.ModelInfo, pb.ModelInfo), (client_mod.ServerStats, pb.ServerStats),
                     (client_mod.Usage, pb.Usage)):
        assert [f.name for f in dataclasses.fields(cls)] == [f.name for f in msg.DESCRIPTOR.fields], cls


def test_health(client, server):
    health_servicer = server[2]
    assert client.health() == "SERVING"
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        assert client.health() == "NOT_SERVING"
    finally:
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    with pytest.raises(PagedServeError) as info:
        client.health("no.such.Service")
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_closed_client_refuses_calls(server):
    c = PagedServeClient(server[0])
    c.close()
    with pytest.raises(ValueError):
        c.model_info()


# -- the async client -----------------------------------------------------------------------------


def test_async_client(server):
    sock, fake, _ = server

    async def main() -> None:
        async with AsyncPagedServeClient(sock) as c:
            stream = c.generate("Hello", request_id="a1", logprobs=1)
            chunks = [ch async for ch in stream]
            assert [ch.text for ch in chunks] == ["H", "e", "l"]
            assert isinstance(chunks[0], GenerationChunk) and chunks[0].logprobs[0].token_id == 72
            assert chunks[-1].finish_reason == "length"
            assert stream.usage.request_id == "a1" and stream.usage.completion_tokens == 3
            assert await c.generate_text("Hello") == "Hel"
            assert await c.generate_text("Hello", n=2) == ["Hel", "Hel"]
            assert await c.chat_text([{"role": "user", "content": "Yo"}]) == "<us"
            assert await c.tokenize("ab") == [1, 97, 98]
            assert await c.detokenize([104, 105]) == "hi"
            assert (await c.model_info()).block_size == 16
            assert (await c.server_stats()).num_waiting == 1
            assert await c.abort("running-1") is True
            assert await c.health() == "SERVING"
            with pytest.raises(TypeError):
                c.generate("x", bogus=1)

    asyncio.run(asyncio.wait_for(main(), 10))


def test_async_errors_cancel_and_deadline(server):
    sock, fake, _ = server

    async def main() -> None:
        async with AsyncPagedServeClient(sock, generate_timeout=0.2) as c:
            with pytest.raises(PagedServeError) as info:
                await c.generate_text("hi", temperature=-2.0)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert not isinstance(info.value, grpc.RpcError)

            fake.slow_ended.clear()
            with pytest.raises(PagedServeError) as info:
                async for _ in c.generate("slow"):
                    pass
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert await asyncio.to_thread(fake.slow_ended.wait, 2.0)

            # breaking out of `async with` over a stream cancels it
            fake.slow_ended.clear()
            async with c.generate("slow", timeout=10.0) as stream:
                async for chunk in stream:
                    assert chunk.text == "."
                    break
            assert await asyncio.to_thread(fake.slow_ended.wait, 2.0)
            assert [ch async for ch in stream] == []

            # cancelling the task that reads the stream cancels the RPC too
            fake.slow_ended.clear()

            streaming = asyncio.Event()

            async def read_all() -> None:
                async for _ in c.generate("slow", timeout=10.0):
                    streaming.set()  # the RPC is in flight: its first chunk is here

            task = asyncio.create_task(read_all())
            await asyncio.wait_for(streaming.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(fake.slow_ended.wait, 2.0)

    asyncio.run(asyncio.wait_for(main(), 10))


def test_cli_stats_into_a_closed_pipe_exits_quietly(server):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (`| head`) is already gone
    try:
        proc = subprocess.run([sys.executable, "-m", "pagedserve.sidecar.cli", "stats", "--socket", server[0]],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
