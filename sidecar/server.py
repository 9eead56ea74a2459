"""The sidecar server: grpc.aio on an anyio (asyncio) loop, one AsyncEngine, health, reflection, systemd.

Start-up: bind the socket(s) and answer health NOT_SERVING at once; load and warm the model in a worker
thread; then SERVING and READY=1. SIGTERM/SIGINT: NOT_SERVING, STOPPING=1, refuse new requests
(gRPC UNAVAILABLE, HTTP 503), give in-flight ones of both APIs `drain_timeout` seconds, abort the rest
(a gRPC stream ends UNAVAILABLE, an HTTP stream with OpenAI's error event, a whole HTTP answer 503), stop
gRPC, then HTTP (uvicorn closes idle keep-alive connections), exit 0.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from pagedserve.runtime.engine.async_engine import AsyncEngine
from pagedserve.runtime.engine.gc_heap import freeze_startup_heap
from pagedserve.runtime.engine.llm_engine import LLMEngine
from pagedserve.runtime.engine.tenant_quotas import TenantQuotas
from pagedserve.runtime.kv_transfer.kv_connector import KVTransferSpec
from pagedserve.runtime.sampling_params import SamplingParams

from .kv_transfer_servicer import KVTransferServicer
from .pb import generation_pb2 as pb
from .pb import generation_pb2_grpc as pb_grpc
from .pb import kv_transfer_pb2 as kv_pb
from .pb import kv_transfer_pb2_grpc as kv_pb_grpc
from .metrics import ServerMetrics
from .peer_proxy import PeerProxy, private_socket_path
from .sd_notify import SystemdNotifier, watchdog_loop
from .admin_servicer import SERVICE_NAME as ADMIN_SERVICE_NAME, AdminServicer
from .pb import admin_pb2_grpc as admin_pb_grpc
from .servicer import GenerationServicer
from .settings import Settings, parse_lora_modules
from .tenant_access import AdminGuard, Callers
from .tenants import load_tenants

if TYPE_CHECKING:
    from .http_api import HttpServer
    from .kv_transfer_client import GrpcKVConnector  # imported when a decode instance connects

log = structlog.get_logger("pagedserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
KV_SERVICE_NAME = kv_pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name
SOCKET_MODE = 0o660
# Responses: one message per chunk, the largest a best_of request's final chunk of one sample (its
# whole text, token ids and logprobs); 64 MiB is far above what max_model_len tokens can make.
MAX_SEND_BYTES = 64 << 20


def max_receive_bytes(max_prompt_chars: int) -> int:
    """The largest request worth reading: a prompt of max_prompt_chars characters of up to 4 UTF-8
    bytes each, plus 1 MiB for the rest (sampling fields, stop strings, token ids up to max_model_len).
    Anything bigger is refused by gRPC (RESOURCE_EXHAUSTED) before it is parsed or copied."""
    return 4 * max_prompt_chars + (1 << 20)


def prepare_socket_path(path: str) -> None:
    """Make room for a unix socket at `path`: create the folder, replace a stale socket safely.

    A socket file nobody listens on is removed; one that a live server answers on, or any other kind of
    file, is left alone and reported, so we never steal a running server's socket or delete a user's file.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if not p.exists() and not p.is_symlink():
        return
    if not stat.S_ISSOCK(p.lstat().st_mode):
        raise ValueError(f"socket path {path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError, socket.timeout, OSError):
        p.unlink(missing_ok=True)  # stale: left behind by a server that died
        return
    finally:
        probe.close()
    raise ValueError(f"socket {path} is in use by a running server")


class SidecarServer:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine: AsyncEngine | None = None
        self.model_name = ""
        self.notifier = SystemdNotifier()
        self.health = health_aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.addresses: list[str] = []
        self.kv_spec: KVTransferSpec | None = None  # once loaded: the handshake's answer
        self.kv_connector: GrpcKVConnector | None = None  # decode role: the connection to the prefill instance
        # The HTTP API's GET /metrics serves the same registry as --metrics-port.
        wants_metrics = settings.metrics_port is not None or settings.http_port is not None
        self.metrics = ServerMetrics(lambda: self.engine) if wants_metrics else None
        self.serving = False  # what health says; the HTTP API answers 503 while False
        self.http: HttpServer | None = None  # the OpenAI-compatible HTTP API, when --http-port is set
        # --tenants: read now, so a file the server cannot use stops it before it binds anything.
        self.tenants = load_tenants(settings.tenants) if settings.tenants else None
        self.callers = Callers(self.tenants)
        self.proxy: PeerProxy | None = None  # the socket's peer credentials (peer_proxy.py), with a tenants file

    async def _set_health(self, serving: bool) -> None:
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> None:
        s = self.settings
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_receive_bytes(s.max_prompt_chars)),
                                          ("grpc.max_send_message_length", MAX_SEND_BYTES),
                                          ("grpc.so_reuseport", 0)],
                                 interceptors=[AdminGuard(self.callers)])  # pagedserve.v1.Admin: admins only
        servicer = GenerationServicer(lambda: self.engine, lambda: self.model_name, s.max_prompt_chars,
                                      s.max_chat_messages, s.slow_reader_timeout, self.metrics, self.callers)
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        kv_pb_grpc.add_KVTransferServicer_to_server(
            KVTransferServicer(lambda: self.engine, lambda: self.kv_spec, s.kv_test_fault), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        admin_pb_grpc.add_AdminServicer_to_server(AdminServicer(lambda: self.engine, s.allow_runtime_lora_updating),
                                                  server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, KV_SERVICE_NAME, ADMIN_SERVICE_NAME,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server)
        await self._set_health(False)
        if s.socket:
            prepare_socket_path(s.socket)
            if self.tenants is not None:  # gRPC on a private socket; the public one reads each caller's credentials
                private = private_socket_path(s.socket)
                self.proxy = self.callers.proxy = PeerProxy(
                    s.socket, private, lambda cred: self.tenants.for_peer(cred.uid, cred.gid))
                server.add_insecure_port(f"unix:{private}")
            else:
                server.add_insecure_port(f"unix:{s.socket}")
            self.addresses.append(f"unix:{s.socket}")
        if tcp := s.tcp_address():
            port = server.add_insecure_port(tcp)
            if port == 0:
                raise ValueError(f"could not bind TCP address {tcp}")
            self.addresses.append(tcp.rsplit(":", 1)[0] + f":{port}")
        await server.start()
        if self.proxy is not None:
            await self.proxy.start()
        if s.socket:
            os.chmod(s.socket, SOCKET_MODE)  # owner and group (the app pods' group) may connect
        self.server = server
        if s.metrics_port is not None:  # loopback only: the figures are for the host's own scraper
            port = self.metrics.serve(s.metrics_port)
            self.addresses.append(f"http://127.0.0.1:{port}/metrics")
        if s.http_port is not None:
            self._start_http()
        log.info("server.listening", addresses=self.addresses)
        self.notifier.status("loading model")

    def _start_http(self) -> None:
        from .http_api import HttpApi, HttpServer  # fastapi and uvicorn load only when the HTTP API is on

        s = self.settings
        api = HttpApi(lambda: self.engine, lambda: self.model_name, lambda: self.serving, s.max_prompt_chars,
                      s.max_chat_messages, self.metrics, s.slow_reader_timeout, s.allow_runtime_lora_updating)
        self.http = HttpServer(api.app(s.api_key, self.tenants), s.http_host, s.http_port)
        self.http.start()
        self.addresses.append(self.http.address)

    async def _stop_http(self) -> None:
        if self.http is not None:
            await self.http.stop()

    async def _stop_proxy(self) -> None:
        if self.proxy is not None:
            await self.proxy.stop()

    async def load(self) -> None:
        t0 = time.monotonic()
        config = self.settings.engine_config()
        if self.tenants is not None:
            config = dataclasses.replace(config, tenant_weights=self.tenants.weights)
        engine = await anyio.to_thread.run_sync(LLMEngine, config)
        await anyio.to_thread.run_sync(load_lora_modules, engine, self.settings.lora_modules)
        await anyio.to_thread.run_sync(self._warm_up, engine)
        self.model_name = engine.model_name
        await anyio.to_thread.run_sync(self._setup_disaggregation, engine)
        self.engine = AsyncEngine(engine, self.settings.max_waiting_requests)
        if self.tenants is not None:
            self.engine.quotas = TenantQuotas(self.tenants.quotas)
        frozen = freeze_startup_heap()  # full collections no longer walk start-up's objects (gc_heap.py)
        log.info("server.model_loaded", model=engine.model_name, seconds=round(time.monotonic() - t0, 2),
                 num_kv_blocks=engine.num_kv_blocks, block_size=engine.block_size, backend=engine.backend.name,
                 tensor_parallel_size=engine.executor.world_size, gc_frozen_objects=frozen)

    def _setup_disaggregation(self, engine: LLMEngine) -> None:
        """Every role answers handshakes; a decode instance connects to its prefill target (may raise)."""
        from pagedserve.runtime.kv_transfer.kv_shm import host_id

        s = self.settings
        spec = engine.kv_transfer_spec(s.role, host_id())
        if s.role == "decode":
            from .kv_transfer_client import connect_decode

            self.kv_connector = connect_decode(s, spec)
            engine.enable_remote_prefill(self.kv_connector, s.prefill_fallback)
        self.kv_spec = spec

    @staticmethod
    def _warm_up(engine: LLMEngine) -> None:
        """One short generation so the first real request does not pay for first-touch costs."""
        engine.add_request("warmup", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()

    async def serve(self) -> None:
        # Signals are caught from the very start; one that arrives while the model loads is handled
        # once loading ends (the load runs in a thread and cannot be interrupted mid-way).
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await self.start()
            try:
                await self.load()
            except BaseException:
                await self.server.stop(None)
                await self._stop_http()
                await self._stop_proxy()
                raise
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._run_engine, tg.cancel_scope)
                if self.notifier.watchdog_interval():
                    tg.start_soon(watchdog_loop, self.notifier)
                await self._set_health(True)
                self.notifier.ready(f"serving {self.model_name}")
                log.info("server.ready", model=self.model_name)
                async for signum in signals:
                    log.info("server.signal", signal=signal.Signals(signum).name)
                    break
                await self.drain()
                tg.cancel_scope.cancel()
        if self.engine.failure is not None:
            return
        # Drained: a repeated SIGTERM during the last moments of shutdown must not turn exit 0 into a kill.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def _run_engine(self, scope: anyio.CancelScope) -> None:
        """Step the engine; if it fails for good (a tensor-parallel rank died), go NOT_SERVING and stop so
        the process exits non-zero and systemd restarts it."""
        await self.engine.run()
        if self.engine.failure is None:
            return
        await self._set_health(False)
        log.error("server.engine_failed", error=str(self.engine.failure), health="NOT_SERVING")
        self.notifier.stopping("engine failed")
        await self.server.stop(grace=1.0)
        await self._stop_http()
        await self._stop_proxy()
        self.engine.shutdown()
        if self.settings.socket:
            Path(self.settings.socket).unlink(missing_ok=True)
        scope.cancel()

    async def drain(self) -> None:
        timeout = self.settings.drain_timeout
        await self._set_health(False)
        self.notifier.stopping(f"draining (up to {timeout:g} s)")
        in_flight = self.engine.num_in_flight
        log.info("server.draining", in_flight=in_flight, drain_timeout_s=timeout)
        aborted = await self.engine.drain(timeout)
        await self.server.stop(grace=2.0)
        await self._stop_http()
        await self._stop_proxy()
        self.engine.stop()
        self.engine.shutdown()  # tensor-parallel rank processes
        if self.kv_connector is not None:
            self.kv_connector.close()
        if self.settings.socket:
            Path(self.settings.socket).unlink(missing_ok=True)
        if self.metrics is not None:
            self.metrics.stop()
        log.info("server.stopped", finished=in_flight - aborted, aborted=aborted)


EXIT_ENGINE_FAILED = 3


def load_lora_modules(engine: LLMEngine, lora_modules: str | None) -> None:
    """--lora-modules name=path ...: read and registered before the server is ready (a bad one stops the start)."""
    from pagedserve.runtime.lora import LoRARequest

    for k, (name, path) in enumerate(parse_lora_modules(lora_modules).items()):
        engine.lora.register(LoRARequest(name, k + 1, path))


def run_server(settings: Settings) -> int:
    """0 after a drain; EXIT_ENGINE_FAILED when the engine failed for good (a rank died)."""
    server = SidecarServer(settings)
    anyio.run(server.serve, backend="asyncio")
    if server.engine is not None and server.engine.failure is not None:
        return EXIT_ENGINE_FAILED
    return 0
