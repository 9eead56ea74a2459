"""The sidecar with --tensor-parallel-size 2: it serves the TP=1 tokens, and a rank that dies mid-request
fails that request clearly, turns health NOT_SERVING and ends the server with a non-zero exit code."""

from __future__ import annotations

import json
import os
import signal
import threading

import grpc
from server_proc import TINY, ServerProcess, client_for

from pagedserve.runtime import LLM, SamplingParams
from pagedserve.sidecar.client import PagedServeError
from pagedserve.sidecar.server import EXIT_ENGINE_FAILED


def _rank_pids(server: ServerProcess) -> list[int]:
    for line in server.log().splitlines():
        if '"executor.started"' in line:
            return json.loads(line)["rank_pids"]
    raise AssertionError(f"no executor.started event in the log:\n{server.log()}")


def test_tp2_server_streams_the_tp1_tokens_then_dies_cleanly_when_a_rank_is_killed(tmp_path):
    server = ServerProcess(tmp_path, "--tensor-parallel-size", "2", "--max-model-len", "512",
                           env={"PAGEDSERVE_CPU_THREADS": "1"})
    try:
        server.wait_serving()
        params = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
        prompt = [3, 14, 15, 92, 65, 35]
        with LLM(TINY, device="cpu", seed=0, num_kv_blocks=64) as offline:
            ref = offline.generate([prompt], SamplingParams(**params))[0].outputs[0].token_ids
        with client_for(server) as c:
            got = [t for ch in c.generate(prompt, **params) for t in ch.token_ids]
            assert got == ref
            (rank1,) = _rank_pids(server)
            # A long request in flight, then the rank dies under it.
            errors: list[PagedServeError] = []
            first_chunk = threading.Event()

            def consume() -> None:
                try:
                    for _ in c.generate(prompt, temperature=0.0, max_tokens=400, ignore_eos=True):
                        first_chunk.set()
                except PagedServeError as e:
                    errors.append(e)
                finally:
                    first_chunk.set()

            t = threading.Thread(target=consume)
            t.start()
            assert first_chunk.wait(60)
            os.kill(rank1, signal.SIGKILL)
            t.join(60)
            assert not t.is_alive(), "the in-flight request must end, not hang"
        assert errors and errors[0].code == grpc.StatusCode.UNAVAILABLE, errors
        assert f"rank 1 (pid {rank1}) exited with code -9" in errors[0].message
        code = server.proc.wait(60)
        assert code == EXIT_ENGINE_FAILED, server.log()
        log = server.log()
        assert '"server.engine_failed"' in log and '"NOT_SERVING"' in log
    finally:
        server.stop()
