"""The pagedserve.v1.KVTransfer servicer: the prefill side of disaggregated serving.

Prefill: run the prompt's full blocks through the engine as a one-token request whose KVExport sink
copies blocks [first_block, n) out of the pool in the step that completes the prompt (into the
decode side's shared segment, or into a buffer this call then streams in checksummed 4 MiB chunks).
The blocks are freed as soon as that step ends; a cancelled call aborts the request and frees them too.
"""

from __future__ import annotations

import time
import uuid
import zlib
from typing import Callable

import anyio
import grpc
import numpy as np
import structlog

from pagedserve.runtime.engine.async_engine import AsyncEngine, EngineStoppedError, QueueFullError
from pagedserve.runtime.kv_transfer.kv_connector import (CHUNK_BYTES, KVBlockIO, KVExport, KVTransferSpec,
                                                         chunk_checksums)
from pagedserve.runtime.kv_transfer.kv_shm import ShmSegment
from pagedserve.runtime.sampling_params import SamplingParams

from .pb import kv_transfer_pb2 as pb
from .servicer import AdapterNotFoundError, lora_for
from .pb import kv_transfer_pb2_grpc as pb_grpc

log = structlog.get_logger("pagedserve.kv")
TP_REFUSAL = "this instance runs tensor parallel (each rank holds a slice of every block) and sends no KV blocks"


def spec_to_proto(s: KVTransferSpec) -> pb.KVHandshake:
    return pb.KVHandshake(role=s.role, model_name=s.model_name, model_fingerprint=s.model_fingerprint,
                          block_size=s.block_size, dtype=s.dtype, num_layers=s.num_layers,
                          num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, max_model_len=s.max_model_len,
                          host_id=s.host_id)


def spec_from_proto(m: pb.KVHandshake) -> KVTransferSpec:
    return KVTransferSpec(m.role, m.model_name, m.model_fingerprint, m.block_size, m.dtype, m.num_layers,
                          m.num_kv_heads, m.head_dim, m.max_model_len, m.host_id)


class KVTransferServicer(pb_grpc.KVTransferServicer):
    def __init__(self, get_engine: Callable[[], AsyncEngine | None], get_spec: Callable[[], KVTransferSpec | None],
                 test_fault: str | None = None) -> None:
        self._get_engine = get_engine
        self._get_spec = get_spec
        self.test_fault = test_fault  # settings.kv_test_fault: corrupt | cut | delay:SECONDS

    async def Handshake(self, request: pb.KVHandshake, context) -> pb.KVHandshake:
        spec = self._get_spec()
        if spec is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        engine = self._get_engine()
        if engine is not None and not engine.can_send_kv_blocks:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, TP_REFUSAL)
        return spec_to_proto(spec)

    async def Prefill(self, request: pb.PrefillRequest, context):
        engine, spec = self._get_engine(), self._get_spec()
        if engine is None or spec is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        if spec.role == "decode":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this instance has role decode and computes no prefills for others")
        if not engine.can_send_kv_blocks:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, TP_REFUSAL)
        ids, bs = list(request.token_ids), spec.block_size
        if not ids or len(ids) % bs or request.first_block >= len(ids) // bs:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token_ids must be a positive whole number of blocks of {bs} tokens and "
                                f"first_block ({request.first_block}) below their block count; got {len(ids)} tokens")
        shape = (len(ids) // bs - request.first_block, *spec.block_shape)
        segment = None
        if request.shm_path:
            try:
                segment = ShmSegment.open(request.shm_path, shape, spec.storage)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            async for msg in self._prefill(engine, spec, request, ids, shape, segment, context):
                yield msg
        finally:
            if segment is not None:
                segment.close()

    async def _prefill(self, engine: AsyncEngine, spec: KVTransferSpec, request: pb.PrefillRequest, ids: list[int],
                       shape: tuple[int, ...], segment: ShmSegment | None, context):
        fault, _, arg = (self.test_fault or "").partition(":")
        if fault == "delay":
            await anyio.sleep(float(arg))  # a deliberately slow prefill instance (tests of the deadline)

        def sink(io: KVBlockIO, block_ids: list[int]) -> np.ndarray:
            out = segment.array if segment is not None else np.empty(shape, dtype=spec.storage)
            io.read_into(block_ids, out)
            return out

        export = KVExport(request.first_block, sink)
        t0 = time.monotonic()
        try:
            async for _ in engine.generate(f"kv-{uuid.uuid4().hex}", ids,
                                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                                           cache_salt=request.cache_salt or None, kv_export=export,
                                           lora_request=lora_for(engine, request.lora_name)):
                pass
        except AdapterNotFoundError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except EngineStoppedError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if export.result is None:
            await context.abort(grpc.StatusCode.INTERNAL, f"the prefill produced no blocks: {export.error}")
        prefill_s = time.monotonic() - t0 - export.export_s
        data: np.ndarray = export.result
        nbytes = data.nbytes
        done = pb.PrefillDone(num_blocks=shape[0], num_bytes=nbytes, export_s=export.export_s, prefill_s=prefill_s)
        crcs: list[int] = []
        view = memoryview(data).cast("B")
        if segment is not None:
            crcs = await anyio.to_thread.run_sync(chunk_checksums, view)
        for i, offset in enumerate(range(0, nbytes, CHUNK_BYTES)):
            piece = view[offset : offset + CHUNK_BYTES]
            crc = crcs[i] if segment is not None else zlib.crc32(piece)
            payload = b"" if segment is not None else bytes(piece)
            if fault == "cut":  # the first chunk's first half arrives, then the stream breaks
                half = len(piece) // 2
                yield pb.PrefillResponse(chunk=pb.KVChunk(offset=offset, data=payload[:half], length=half,
                                                          crc32=zlib.crc32(piece[:half])))
                await context.abort(grpc.StatusCode.UNAVAILABLE, "test fault: transfer cut")
            if fault == "corrupt":  # one byte flips after its checksum was taken
                if segment is None:
                    payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
                else:
                    view[offset] ^= 0xFF
            yield pb.PrefillResponse(chunk=pb.KVChunk(offset=offset, data=payload, length=len(piece), crc32=crc))
        engine.count_kv_sent(shape[0], nbytes)  # counted before the last message, so a reader never sees it late
        yield pb.PrefillResponse(done=done)
        log.info("kv.sent", request_id=request.request_id, blocks=shape[0], cached_blocks=request.first_block,
                 bytes=nbytes, prefill_s=round(prefill_s, 4), export_s=round(export.export_s, 6),
                 transport="shm" if segment is not None else "grpc")
