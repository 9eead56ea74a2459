"""Helpers shared by the HTTP API's tests (tests/sidecar/test_http_*.py)."""

from __future__ import annotations

import json

from server_proc import ServerProcess, client_for


def http_address(srv: ServerProcess) -> str:
    """The HTTP API's address, from the server's `server.listening` log line (port 0: the kernel chose it)."""
    for line in srv.log().splitlines():
        if '"server.listening"' in line:
            return next(a for a in json.loads(line)["addresses"] if a.startswith("http://"))
    raise AssertionError(f"no server.listening line:\n{srv.log()}")


def grpc_greedy_ids(server: ServerProcess, prompt: list[int], n: int) -> list[int]:
    with client_for(server) as c:
        return [t for ch in c.generate(prompt, max_tokens=n, temperature=0.0, ignore_eos=True) for t in ch.token_ids]
