"""The sidecar end to end: a real server process on a unix socket, spoken to over gRPC."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from server_proc import TINY, ServerProcess, client_for, wait_idle

from pagedserve.cupy_kernels.host.blas_threads import blas_info
from pagedserve.cupy_kernels.kernel_set import numba_code_path
from pagedserve.runtime import LLM, SamplingParams
from pagedserve.sidecar import client as client_mod
from pagedserve.sidecar.client import AsyncPagedServeClient, PagedServeError


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("srv"), "--max-model-len", "512", "--max-prompt-chars", "2000",
                        "--max-chat-messages", "8")
    srv.wait_serving()
    yield srv
    assert srv.stop() == 0, srv.log()


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture(scope="module")
def offline():
    return LLM(TINY, device="cpu", seed=0, kv_cache_memory_bytes=64 << 20)


def greedy_ids(offline, prompt, n):
    return offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids  # noqa: E501


def assert_serves_normally(c, offline):
    """A plain greedy request after trouble gets exactly the offline engine's tokens, and the pool empties."""
    stream = c.generate([5, 6, 7], max_tokens=3, temperature=0.0, ignore_eos=True)
    chunks = list(stream)
    assert [t for ch in chunks for t in ch.token_ids] == greedy_ids(offline, [5, 6, 7], 3)
    assert chunks[-1].finish_reason == "length"
    assert wait_idle(c).kv_blocks_used == 0


def prompts(n):
    return [[3 + (i * 7 + j) % 500 for j in range(5 + i % 40)] for i in range(n)]


def test_socket_mode_and_model_info(server):
    assert stat.S_IMODE(os.stat(server.socket).st_mode) == 0o660
    with client_for(server) as c:
        info = c.model_info()
    assert info.architecture == "llama" and info.vocab_size == 512 and info.max_model_len == 512
    assert info.block_size == 16 and info.backend == "numpy"
    # the CPU kernel set and the BLAS kernel numpy's matmuls run on (threadpoolctl's "architecture")
    # cpu_kernels "auto": the numba set (a runtime dependency), but for baseline x86-64 code (kernel_set.cpu_kernels)
    assert info.numba_code_path == numba_code_path() and info.numba_code_path in ("avx512", "avx2", "baseline")
    assert info.kernels == ("numpy" if info.numba_code_path == "baseline" else "numba")
    assert info.blas_kernel == blas_info()["architecture"] and info.blas_threads >= 1
    assert info.kv_cache_dtype == "float32"  # kv_cache_dtype "auto" on the CPU (field 13; `pagedserve stats`)


def test_stream_equals_offline_tokens(server, offline):
    params = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = offline.generate([prompts(3)[2]], SamplingParams(**params))[0].outputs[0]
    with client_for(server) as c:
        stream = c.generate(prompts(3)[2], **params)
        chunks = list(stream)
    assert [t for ch in chunks for t in ch.token_ids] == ref.token_ids
    assert "".join(ch.text for ch in chunks) == ref.text
    assert chunks[-1].finish_reason == "length"
    assert stream.usage.prompt_tokens == len(prompts(3)[2]) and stream.usage.completion_tokens == 24
    assert stream.usage.ttft_s > 0


def test_64_concurrent_streams_from_separate_clients(server, offline):
    ps = prompts(64)
    seeded = [dict(temperature=0.8, top_p=0.9, seed=i, max_tokens=16 + i % 9, ignore_eos=True) for i in range(64)]
    refs = offline.generate(ps, [SamplingParams(**p) for p in seeded])

    def one(i):
        with client_for(server) as c:
            return [t for ch in c.generate(ps[i], **seeded[i]) for t in ch.token_ids]

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    for i, got in enumerate(results):
        assert got == refs[i].outputs[0].token_ids, f"stream {i}"
    with client_for(server) as c:
        assert wait_idle(c).kv_blocks_used == 0


def test_cancelled_streams_free_their_blocks(server, offline):
    with client_for(server) as c:
        stream = c.generate(prompts(1)[0], temperature=0.0, max_tokens=400, ignore_eos=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        assert wait_idle(c).kv_blocks_used == 0

        streams = [c.generate(p, temperature=0.0, max_tokens=400, ignore_eos=True) for p in prompts(100)]
        for s in streams[::2]:
            next(iter(s), None)  # half of them have started producing
        for s in streams:
            s.close()
        stats = wait_idle(c)
        assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
        assert_serves_normally(c, offline)


def test_prefix_cache_hits_show_in_usage_and_stats(server):
    shared = [7 + (j * 13) % 400 for j in range(64)]  # four full blocks
    with client_for(server) as c:
        first = c.generate(shared + [11, 12], temperature=0.0, max_tokens=2, ignore_eos=True)
        list(first)
        second = c.generate(shared + [21, 22, 23], temperature=0.0, max_tokens=2, ignore_eos=True)
        list(second)
        stats = wait_idle(c)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 64
    assert 0.0 < stats.prefix_cache_hit_rate < 1.0


@pytest.mark.parametrize("kwargs,needle", [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt=[5] * 600), "exceeds max_model_len (512)"),
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt="hi", top_p=2.0), "top_p"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt=[5, 9999]), "token ids must be in [0, 512)"),
    (dict(prompt="x" * 2001), "2001 characters; the limit is 2000"),
    # The reported bug: this allocated ~24 GB and got the server OOM-killed.
    (dict(prompt="hi", best_of=2**31 - 1, max_tokens=4), "best_of (2147483647) exceeds max_num_seqs (256)"),
    (dict(prompt="hi", logprobs=21), "logprobs must be in [0, 20] (max_logprobs), got 21"),
    (dict(prompt="hi", stop_token_ids=[600]), "stop_token_ids must be in [0, 512); got [600]"),
    (dict(prompt="hi", top_k=100000), "top_k (100000) exceeds the vocabulary size (512)"),
])
def test_bad_input_is_invalid_argument_and_the_server_carries_on(server, offline, kwargs, needle):
    with client_for(server) as c:
        prompt = kwargs.pop("prompt")
        with pytest.raises(PagedServeError) as err:
            list(c.generate(prompt, **kwargs))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.message
        assert_serves_normally(c, offline)


def test_headers_come_on_admission_before_a_best_of_request_is_done(server, offline):
    # best_of > n sends no chunk until every sample is done; the headers must not wait for that. The
    # request is still in the engine when its headers arrive, so the Abort RPC finds it and its one
    # chunk is the aborted whole. (Before headers were sent on admission they came with that chunk,
    # once the request had finished, and the Abort found nothing.)
    with client_for(server) as c:
        stream = c.generate([5, 6, 7], n=1, best_of=4, max_tokens=480, ignore_eos=True, seed=1,
                            request_id="best-of-headers")
        admission = stream.admitted()
        assert admission == client_mod.Admission(request_id="best-of-headers", prompt_tokens=3)
        assert c.abort("best-of-headers") is True
        chunks = list(stream)
        assert [ch.finish_reason for ch in chunks] == ["abort"]
        assert stream.usage.request_id == "best-of-headers"
        # A normal stream: the headers carry the id the server assigned (the one usage repeats later).
        stream = c.generate("hello", max_tokens=2, temperature=0.0)
        admission = stream.admitted()
        list(stream)
        assert admission.request_id == stream.usage.request_id and len(admission.request_id) == 32
        assert admission.prompt_tokens == stream.usage.prompt_tokens > 0
        # A refused request gets no headers: admitted() raises its status.
        with pytest.raises(PagedServeError) as err:
            c.generate("hi", best_of=2**31 - 1).admitted()
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "best_of" in err.value.message
        assert_serves_normally(c, offline)


async def _async_admission(server) -> tuple:
    async with AsyncPagedServeClient(server.socket) as c:
        stream = c.generate([5, 6, 7], n=2, best_of=3, max_tokens=4, ignore_eos=True, request_id="async-ids-\u00e9")
        admission = await stream.admitted()
        chunks = [ch async for ch in stream]
        return admission, chunks


def test_async_client_admission(server):
    admission, chunks = asyncio.run(_async_admission(server))
    assert admission == client_mod.Admission(request_id="async-ids-\u00e9", prompt_tokens=3)  # not ASCII: -bin header
    assert sorted(ch.index for ch in chunks) == [0, 1] and all(len(ch.token_ids) == 4 for ch in chunks)


def test_bad_chat_messages(server, offline):
    with client_for(server) as c:
        with pytest.raises(PagedServeError) as err:
            list(c.chat([{"role": "wizard", "content": "hi"}]))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "messages[0].role 'wizard'" in err.value.message
        with pytest.raises(PagedServeError) as err:
            list(c.chat([{"role": "user", "content": "y" * 5000}]))
        assert "messages[0].content is 5000 characters" in err.value.message
        with pytest.raises(PagedServeError) as err:
            list(c.chat([{"role": "user", "content": "hi"}] * 9))
        assert "chat.messages has 9 messages; the limit is 8" in err.value.message
        with pytest.raises(PagedServeError) as err:
            list(c.chat([{"role": "user", "content": "z" * 900}] * 3))
        assert "chat.messages hold 2700 characters in all; the limit is 2000" in err.value.message
        # A message far beyond what max_prompt_chars allows is refused by gRPC before it is parsed.
        with pytest.raises(PagedServeError) as err:
            list(c.generate("w" * (2 << 20), max_tokens=1))
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        messages = [{"role": "user", "content": "hi"}]
        text = c.chat_text(messages, max_tokens=4, temperature=0.0)
        ref = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]
        assert text == ref.text and ref.token_ids
        assert_serves_normally(c, offline)


def test_the_developer_role_is_a_system_turn_over_grpc(server):
    """OpenAI's `developer` role (its newer name for system instructions) reaches the chat template as system."""
    with client_for(server) as c:
        as_system = c.tokenize([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
        as_developer = c.tokenize([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
        assert as_developer == as_system


def test_tokenize_detokenize_and_abort(server):
    with client_for(server) as c:
        ids = c.tokenize("hello world")
        assert ids and c.detokenize(ids) == "hello world"
        with pytest.raises(PagedServeError) as err:
            c.detokenize([100000])
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        stream = c.generate([5, 6, 7], request_id="to-abort", max_tokens=400, temperature=0.0, ignore_eos=True)
        first = next(stream)
        assert first.token_ids
        assert c.abort("to-abort") is True
        rest = list(stream)
        assert rest and rest[-1].finish_reason == "abort"
        assert c.abort("no-such-request") is False
        assert wait_idle(c).kv_blocks_used == 0


def test_reflection_lists_the_services(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(f"unix:{server.socket}") as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"pagedserve.v1.Generation", "grpc.health.v1.Health"} <= services


@pytest.mark.slow
def test_queue_limit_answers_resource_exhausted(tmp_path, offline):
    """One running seat and two waiting places. Once a first long request is running (it has a token), 7 more
    sent at once: exactly 2 wait, 5 are refused at once with RESOURCE_EXHAUSTED, and every accepted one completes.
    (Sending all 8 at once would leave it to timing whether the first still counts as waiting when the third
    arrives: the scheduler moves a request from waiting to running only at its next step.)"""
    srv = ServerProcess(tmp_path, "--max-waiting-requests", "2", "--max-num-seqs", "1")
    try:
        srv.wait_serving()
        with client_for(srv) as c:
            first = c.generate([5, 6, 4], max_tokens=2000, temperature=0.0, ignore_eos=True)
            assert next(first).token_ids
            streams = [c.generate([5, 6, 7 + i], max_tokens=2000, temperature=0.0, ignore_eos=True) for i in range(7)]
            assert list(first)[-1].finish_reason == "length"
            outcomes = []
            for s in streams:
                try:
                    chunks = list(s)
                    outcomes.append(chunks[-1].finish_reason)
                except PagedServeError as e:
                    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    assert "max_waiting_requests=2" in e.message
                    outcomes.append("refused")
            assert sorted(outcomes) == ["length"] * 2 + ["refused"] * 5, outcomes
            assert_serves_normally(c, offline)
    finally:
        assert srv.stop() == 0, srv.log()


def test_sigterm_drains_running_streams_and_exits_zero(tmp_path):
    srv = ServerProcess(tmp_path, "--drain-timeout", "1.5")
    srv.wait_serving()
    outcomes: list[str] = []
    lock = threading.Lock()
    started = threading.Barrier(17)

    def stream(i):
        with client_for(srv) as c:
            # Half are short (they finish inside the drain window), half too long to finish.
            s = c.generate([5 + i, 6, 7], max_tokens=20 if i % 2 else 100000 // 64, temperature=0.0, ignore_eos=True)
            try:
                next(s)
                started.wait()
                chunks = list(s)
                result = "finished:" + (chunks[-1].finish_reason if chunks else "?")
            except PagedServeError as e:
                result = f"error:{e.code.name}:{e.message}"
            with lock:
                outcomes.append(result)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    started.wait()
    srv.proc.terminate()
    for t in threads:
        t.join(30)
    code = srv.proc.wait(30)
    srv.stop()
    assert code == 0, srv.log()
    assert len(outcomes) == 16
    for o in outcomes:
        assert o == "finished:length" or (o.startswith("error:UNAVAILABLE") and "shutting down" in o), o
    assert any(o.startswith("finished") for o in outcomes)
    assert '"event": "server.stopped"' in srv.log()


@pytest.mark.slow
def test_health_goes_not_serving_then_serving_and_systemd_hears_it(tmp_path):
    """On the embedded model (slow enough to load that NOT_SERVING is observable), with a fake
    NOTIFY_SOCKET: READY=1 after loading, WATCHDOG=1 pings, STOPPING=1 on SIGTERM."""
    import socket as socketlib

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    notify_path = str(tmp_path / "notify.sock")
    notify = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(0.2)
    messages: list[str] = []
    done = threading.Event()

    def read_notify():  # drain the datagram queue as messages arrive (the kernel keeps only ~10)
        while not done.is_set():
            try:
                messages.append(notify.recv(4096).decode())
            except OSError:
                pass

    reader = threading.Thread(target=read_notify)
    reader.start()
    srv = ServerProcess(tmp_path, env={"NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "300000"}, model=None)
    seen: list[str] = []
    try:
        srv.wait_socket()
        with grpc.insecure_channel(f"unix:{srv.socket}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
            for resp in watch:
                seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
                if seen[-1] == "SERVING":
                    watch.cancel()
                    break
        # WATCHDOG_USEC=300000: a ping at least every 150 ms once READY=1 is sent
        wait_for(lambda: "WATCHDOG=1" in "\n".join(messages), 10.0, "no WATCHDOG=1 after SERVING")
        srv.proc.terminate()
        assert srv.proc.wait(30) == 0, srv.log()
        # STOPPING=1 went out before the process exited; the reader picks it up within its 0.2 s timeout
        wait_for(lambda: "STOPPING=1" in "\n".join(messages), 10.0, "no STOPPING=1 after SIGTERM")
    finally:
        srv.stop()
        done.set()
        reader.join()
        notify.close()
    assert seen[0] == "NOT_SERVING" and seen[-1] == "SERVING", seen
    states = [line for m in messages for line in m.splitlines()]
    assert "READY=1" in states and "WATCHDOG=1" in states and "STOPPING=1" in states, states
    assert states.index("READY=1") < states.index("STOPPING=1")
