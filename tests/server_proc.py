"""Start a real `pagedserve serve` process on a unix socket for the sidecar tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pagedserve.sidecar.client import PagedServeClient, PagedServeError

TINY = str(Path(__file__).parent / "data" / "tiny-llama")
FAULT_SERVER = str(Path(__file__).parent / "fault_server.py")


class ServerProcess:
    def __init__(self, tmp: Path, *args: str, env: dict | None = None, model: str | None = TINY,
                 entry: tuple[str, ...] = ("-m", "pagedserve.sidecar.cli")) -> None:
        """`entry`: what runs the CLI, e.g. (str(FAULT_SERVER),) for the server with injected faults."""
        self.socket = str(tmp / "ps.sock")
        self.log_path = tmp / "server.log"
        cmd = [sys.executable, *entry, "serve", "--socket", self.socket, "--device", "cpu",
               "--kv-cache-memory-bytes", str(64 << 20), *args]
        if model is not None:
            cmd += ["--model", model]
        # PYTHONFAULTHANDLER: a crash leaves every thread's Python traceback in the log.
        full_env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def wait_socket(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{self.log()}")
            time.sleep(0.005)

    def wait_serving(self, timeout: float = 120.0) -> None:
        self.wait_socket(timeout)
        deadline = time.monotonic() + timeout
        with PagedServeClient(self.socket, timeout=2.0) as c:
            while True:
                try:
                    if c.health() == "SERVING":
                        return
                except PagedServeError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server never became SERVING:\n{self.log()}")
                time.sleep(0.05)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._log.close()


def client_for(server: ServerProcess, **kw) -> PagedServeClient:
    return PagedServeClient(server.socket, **kw)


def wait_idle(client: PagedServeClient, timeout: float = 30.0):
    """Poll stats until nothing runs or waits and no KV block is in use."""
    deadline = time.monotonic() + timeout
    while True:
        s = client.server_stats()
        if s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0:
            return s
        if time.monotonic() > deadline:
            return s
        time.sleep(0.05)
