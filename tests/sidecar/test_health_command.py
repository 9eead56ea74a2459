"""`pagedserve health`, the exec probe: 0 when the server is SERVING, 1 when it answers anything else (with
--live: 0 on any answer), 2 when nothing answers within --timeout, with a line on stderr saying why.

A bare grpc.health.v1 server sets each status at will (the sidecar's own NOT_SERVING windows, loading and
draining, are too short to hit on the tiny model); one real `pagedserve serve` process checks the command
against the server it is for, before and after it stops."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from server_proc import ServerProcess

from pagedserve.sidecar.cli import main

HealthStatus = health_pb2.HealthCheckResponse


@pytest.fixture
def health_server(tmp_path):
    """(socket path, HealthServicer): a gRPC server with only the health service, status set by the test."""
    path = str(tmp_path / "health.sock")
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    yield path, servicer
    server.stop(None)


def run_health(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["health", *args])
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


def test_serving_is_0_not_serving_is_1_and_live_accepts_any_answer(health_server, capsys):
    path, servicer = health_server
    servicer.set("", HealthStatus.SERVING)
    assert run_health(capsys, "--socket", path) == (0, "SERVING", "")
    servicer.set("", HealthStatus.NOT_SERVING)  # loading or draining
    assert run_health(capsys, "--socket", path) == (1, "NOT_SERVING", "")
    assert run_health(capsys, "--socket", path, "--live") == (0, "NOT_SERVING", "")
    # A service the server does not know is an answer too, not an unreachable server.
    assert run_health(capsys, "--socket", path, "--service", "no.such.Service") == (1, "SERVICE_UNKNOWN", "")
    servicer.set("pagedserve.v1.Generation", HealthStatus.SERVING)
    assert run_health(capsys, "--socket", path, "--service", "pagedserve.v1.Generation") == (0, "SERVING", "")


def test_a_tcp_address_works_too(capsys):
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", HealthStatus.SERVING)
        assert run_health(capsys, "--socket", f"127.0.0.1:{port}") == (0, "SERVING", "")
    finally:
        server.stop(None)


def test_no_server_is_2_with_a_message_naming_the_socket(tmp_path, capsys):
    path = str(tmp_path / "nobody.sock")
    code, out, err = run_health(capsys, "--socket", path)
    assert code == 2 and out == ""
    assert err.startswith(f"pagedserve health: unix:{path} did not answer") and "UNAVAILABLE" in err, err
    assert "No such file or directory" in err, err


def test_a_server_that_never_answers_is_2_after_the_timeout(tmp_path, capsys):
    """A socket that accepts connections but never speaks (a hung process): the probe gives up at --timeout."""
    path = str(tmp_path / "hung.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hung:
        hung.bind(path)
        hung.listen(8)  # the kernel completes connects; nobody reads
        t0 = time.monotonic()
        code, out, err = run_health(capsys, "--socket", path, "--timeout", "0.5")
        elapsed = time.monotonic() - t0
    assert code == 2 and "DEADLINE_EXCEEDED" in err and "timeout 0.5 s" in err, err
    assert 0.4 < elapsed < 10, elapsed


def test_a_bad_timeout_is_refused(capsys):
    code, _, err = run_health(capsys, "--timeout", "0")
    assert code == 2 and "--timeout must be > 0 seconds" in err, err


def test_against_a_real_server_before_and_after_it_stops(tmp_path):
    """The installed command line, as a probe runs it: the socket from $PAGEDSERVE_SOCKET or --socket."""
    srv = ServerProcess(tmp_path)
    cmd = [sys.executable, "-m", "pagedserve.sidecar.cli", "health", "--timeout", "10"]
    try:
        srv.wait_serving()
        env = {**os.environ, "PAGEDSERVE_SOCKET": srv.socket}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout.strip()) == (0, "SERVING"), done.stderr
        done = subprocess.run([*cmd, "--live", "--socket", srv.socket], capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout.strip()) == (0, "SERVING"), done.stderr
    finally:
        assert srv.stop() == 0, srv.log()
    done = subprocess.run([*cmd, "--socket", srv.socket], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "", done
    assert f"unix:{srv.socket} did not answer" in done.stderr, done.stderr


def test_a_probe_loads_neither_the_engine_nor_numpy(tmp_path):
    """Kubernetes runs the command every few seconds beside the server: it imports what one check needs."""
    code = ("import sys\nfrom pagedserve.sidecar.cli import main\n"
            f"assert main(['health', '--socket', {str(tmp_path / 'x.sock')!r}]) == 2\n"
            "heavy = ('numpy', 'pagedserve.runtime', 'pagedserve.sidecar.settings')\n"
            "print(sorted(m for m in heavy if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)
