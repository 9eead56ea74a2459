"""uvicorn serving the HTTP API as a task on the sidecar's own event loop (the sidecar keeps SIGTERM: drain)."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the sidecar owns SIGTERM and SIGINT (they drain the whole server)
        yield


class HttpServer:
    """uvicorn on the running event loop, on a socket bound at construction (a taken port fails at start,
    and port 0 is known at once)."""

    def __init__(self, app, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=2048)
        self.sock.setblocking(False)
        self.address = f"http://{host if family == socket.AF_INET else f'[{host}]'}:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_keep_alive=5,
                                timeout_graceful_shutdown=2)
        self.server = _Uvicorn(config)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))

    async def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        if self.task is None:
            self.sock.close()
            return
        done, _ = await asyncio.wait([self.task], timeout=timeout)
        if not done:
            self.task.cancel()
