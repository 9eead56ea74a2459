"""The decode side's KV connector: asks the prefill instance for a prompt's blocks over gRPC.

Control always goes through the KVTransfer.Prefill call; the bytes go through a shared-memory segment
(same host, runtime/kv_transfer/kv_shm.py) or in the call's stream as crc32-checked chunks of at most 4 MiB.
Each transfer runs in a thread of a small pool, so the engine's step loop never waits on the network;
the engine polls ``get_finished()``.

Outcomes: ok; broken (data came but was cut or corrupt: the engine recomputes locally, once); or
failed (target down, late past ``prefill_timeout``, refused at handshake: ``--prefill-fallback``
decides between a local prefill and UNAVAILABLE).
"""

from __future__ import annotations

import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import structlog

from pagedserve.runtime.kv_transfer.kv_connector import (KVConnector, KVHandshakeError, KVLoadResult, KVLoadSpec,
                                                         KVTransferSpec, check_compatible)
from pagedserve.runtime.kv_transfer.kv_shm import ShmSegment

from .kv_transfer_servicer import spec_from_proto, spec_to_proto
from .pb import kv_transfer_pb2 as pb
from .pb import kv_transfer_pb2_grpc as pb_grpc
from .settings import Settings, prefill_target_address

log = structlog.get_logger("pagedserve.kv")

MAX_MESSAGE_BYTES = 8 << 20  # one 4 MiB chunk plus framing
HANDSHAKE_TIMEOUT_S = 5.0
RECONNECT_MAX_MS = 2000


class _Broken(Exception):
    """Data arrived but cannot be used (cut, corrupt, out of order)."""


class GrpcKVConnector(KVConnector):
    def __init__(self, target: str, local: KVTransferSpec, transport: str = "auto", timeout_s: float = 60.0,
                 max_concurrent: int = 16) -> None:
        super().__init__()
        self.target = target
        self.local = local
        self.transport = transport
        self.timeout_s = timeout_s
        self.remote: KVTransferSpec | None = None
        # Calls fail fast while the target is down (the request falls back at once), and the channel retries
        # the connection at least every RECONNECT_MAX_MS, so a target started later is found within seconds.
        self._channel = grpc.insecure_channel(prefill_target_address(target), options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS)])
        self._stub = pb_grpc.KVTransferStub(self._channel)
        self._pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="kv-fetch")
        self._calls: dict[str, grpc.Call] = {}
        self._aborted: set[str] = set()
        self._calls_lock = threading.Lock()
        self._handshake_lock = threading.Lock()

    def handshake(self, timeout: float = HANDSHAKE_TIMEOUT_S) -> KVTransferSpec:
        """Exchange specs; KVHandshakeError if the blocks would not fit, grpc.RpcError if unreachable."""
        try:
            remote = spec_from_proto(self._stub.Handshake(spec_to_proto(self.local), timeout=timeout))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # it answered, and said no
                raise KVHandshakeError(f"prefill target {self.target} refused the handshake: {e.details()}") from None
            raise
        check_compatible(self.local, remote, self.target)
        same_host = remote.host_id == self.local.host_id
        self.transport_name = "shm" if self.transport == "shm" or (self.transport == "auto" and same_host) else "grpc"
        if self.transport_name == "shm" and not same_host:
            raise KVHandshakeError(f"kv_transport shm needs the prefill target on this host; {self.target} runs on "
                                   f"{remote.host_id!r}, this instance on {self.local.host_id!r}")
        self.remote = remote
        log.info("kv.handshake", target=self.target, remote_role=remote.role, model=remote.model_name,
                 transport=self.transport_name)
        return remote

    def start_load(self, spec: KVLoadSpec) -> None:
        self._pool.submit(self._fetch, spec)

    def abort(self, request_id: str) -> None:
        with self._calls_lock:
            self._aborted.add(request_id)
            call = self._calls.pop(request_id, None)
        if call is not None:
            call.cancel()  # the prefill side aborts its request and frees its blocks

    def close(self) -> None:
        with self._calls_lock:
            calls = list(self._calls.values())
        for call in calls:
            call.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._channel.close()

    def _fetch(self, spec: KVLoadSpec) -> None:
        rid = spec.request_id
        segment: ShmSegment | None = None
        received = 0
        try:
            if self.remote is None:
                with self._handshake_lock:
                    if self.remote is None:
                        self.handshake(min(self.timeout_s, HANDSHAKE_TIMEOUT_S))
            shape = (len(spec.dst_block_ids), *self.local.block_shape)
            if self.transport_name == "shm":
                segment = ShmSegment.create(shape, self.local.storage)
            request = pb.PrefillRequest(request_id=rid, token_ids=spec.token_ids, cache_salt=spec.cache_salt or "",
                                        first_block=spec.first_block, lora_name=spec.lora_name or "",
                                        shm_path=str(segment.path) if segment is not None else "")
            with self._calls_lock:
                if rid in self._aborted:
                    return
                call = self._stub.Prefill(request, timeout=self.timeout_s)
                self._calls[rid] = call
            buf = segment.array if segment is not None else np.empty(shape, dtype=self.local.storage)
            view = memoryview(buf).cast("B")
            done, t_first = None, None
            for msg in call:
                t_first = t_first or time.monotonic()
                if msg.HasField("done"):
                    done = msg.done
                    break
                c = msg.chunk
                size = len(c.data) if segment is None else c.length
                if c.offset != received or received + size > len(view):
                    raise _Broken(f"chunk at byte {c.offset} out of order ({received} received of {len(view)})")
                if segment is None:
                    view[received : received + size] = c.data
                if zlib.crc32(view[received : received + size]) != c.crc32:
                    raise _Broken(f"checksum mismatch in the chunk at byte {c.offset}")
                received += size
            if done is None:
                raise _Broken("the stream ended before the transfer was done (cut)")
            if received != len(view):
                raise _Broken(f"the stream ended after {received} of {len(view)} bytes (cut)")
            seg, segment = segment, None  # the engine releases it once the blocks are in its pool
            self._deliver(KVLoadResult(rid, data=buf, num_bytes=len(view), transport=self.transport_name,
                                       transfer_s=done.export_s + time.monotonic() - t_first,
                                       release=seg.close if seg is not None else (lambda: None)))
        except _Broken as e:
            self._deliver(KVLoadResult(rid, error=f"transfer broken: {e}", broken=True))
        except KVHandshakeError as e:
            log.error("kv.handshake_failed", target=self.target, error=str(e))
            self._deliver(KVLoadResult(rid, error=f"handshake refused: {e}"))
        except grpc.RpcError as e:
            with self._calls_lock:
                if rid in self._aborted:
                    return  # we cancelled it: the request is gone
            code = e.code().name if hasattr(e, "code") else "UNKNOWN"
            details = e.details() if hasattr(e, "details") else str(e)
            cut = f"transfer broken after {received} bytes: " if received else ""
            self._deliver(KVLoadResult(rid, error=f"{cut}{code}: {details}", broken=received > 0))
        except Exception as e:  # a local failure (no room in /dev/shm...): prefill here instead
            log.error("kv.fetch_failed", request_id=rid, error=repr(e))
            self._deliver(KVLoadResult(rid, error=f"local error: {e!r}"))
        finally:
            if segment is not None:
                segment.close()
            with self._calls_lock:
                self._calls.pop(rid, None)
                self._aborted.discard(rid)


def connect_decode(settings: Settings, local: KVTransferSpec) -> GrpcKVConnector:
    """Build the decode role's connector and try the handshake now: a wrong target fails the start.

    A target that is not up yet is not an error (requests fall back until it is); the handshake is then
    retried with the first transfer.
    """
    connector = GrpcKVConnector(settings.prefill_target, local, settings.kv_transport, settings.prefill_timeout)
    try:
        connector.handshake()
    except KVHandshakeError:
        connector.close()
        raise
    except grpc.RpcError as e:
        log.warning("kv.prefill_target_unreachable", target=settings.prefill_target, error=e.code().name,
                    note="requests fall back until it answers")
    return connector


__all__ = ["GrpcKVConnector", "connect_decode"]
