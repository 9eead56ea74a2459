"""Faults in a real server process: one request's failure is its own; a dead engine worker ends the
process with a non-zero status (systemd restarts it) instead of leaving a server that hangs."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_proc import FAULT_SERVER, ServerProcess, client_for, wait_idle

from pagedserve.sidecar.client import PagedServeError


def long_stream(srv, results, key, max_tokens, started=None):
    try:
        with client_for(srv) as c:
            chunks = []
            for ch in c.generate([5, 6, 7], max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                chunks.append(ch)
                if started is not None:
                    started.set()
            results[key] = ("ok", sum(len(ch.token_ids) for ch in chunks), chunks[-1].finish_reason)
    except PagedServeError as e:
        results[key] = ("error", e.code, e.message)


def test_a_failing_request_fails_alone_then_a_dead_worker_exits_nonzero(tmp_path):
    srv = ServerProcess(tmp_path, entry=(FAULT_SERVER,))
    srv.wait_serving()
    try:
        results: dict = {}
        t = threading.Thread(target=long_stream, args=(srv, results, "long", 300))
        t.start()
        with client_for(srv) as c:
            with pytest.raises(PagedServeError) as err:
                list(c.generate([9, 10, 11], request_id="fail-1", max_tokens=50, temperature=0.0, ignore_eos=True))
            assert err.value.code == grpc.StatusCode.INTERNAL
            assert "request failed while updating and detokenizing its output" in err.value.message
            assert "injected fault" in err.value.message
            t.join(120)
            assert results["long"] == ("ok", 300, "length")
            assert wait_idle(c).kv_blocks_used == 0
            assert c.health() == "SERVING"

            # Now the worker itself dies while a stream is in flight.
            with grpc.insecure_channel(f"unix:{srv.socket}") as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
                started = threading.Event()
                t = threading.Thread(target=long_stream, args=(srv, results, "cut", 2000, started))
                t.start()
                assert started.wait(30)
                with pytest.raises(PagedServeError) as err:
                    list(c.generate([9, 10], request_id="kill-worker", max_tokens=5))
                assert err.value.code == grpc.StatusCode.UNAVAILABLE and "engine worker died" in err.value.message
                assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        t.join(60)
        assert results["cut"][0] == "error" and results["cut"][1] == grpc.StatusCode.UNAVAILABLE, results["cut"]
        assert srv.proc.wait(30) == 3, srv.log()  # server.EXIT_ENGINE_FAILED
        assert '"event": "server.engine_failed"' in srv.log()
    finally:
        srv.stop()


def test_settings_the_host_cannot_hold_are_refused_at_start(tmp_path):
    srv = ServerProcess(tmp_path, "--kv-cache-memory-bytes", str(1 << 50))  # a 1 PiB KV pool
    code = srv.proc.wait(60)
    log = srv.log()
    srv.stop()
    # Exit 2 = bad settings: the unit's RestartPreventExitStatus=2 keeps systemd from retrying a typo.
    assert code == 2, log
    assert "pagedserve: error: the settings need" in log and "lower kv_cache_memory_bytes" in log
