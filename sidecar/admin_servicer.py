"""pagedserve.v1.Admin: LoRA adapters loaded, unloaded and listed at run time (protos/pagedserve/v1/admin.proto).

Load and Unload are refused (FAILED_PRECONDITION) unless the server was started with
--allow-runtime-lora-updating (PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING=1), vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING.
The disk read of a load runs in a worker thread (runtime/lora/view.py), never on the event loop.
"""

from __future__ import annotations

from typing import Callable

import grpc

from pagedserve.runtime.engine.async_engine import AsyncEngine

from .pb import admin_pb2 as pb
from .pb import admin_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Admin"].full_name
RUNTIME_UPDATES_OFF = ("runtime LoRA updates are off: start the server with --allow-runtime-lora-updating "
                       "(PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING=1)")


def adapter_message(request) -> pb.LoRAAdapter:
    return pb.LoRAAdapter(lora_name=request.lora_name, lora_int_id=request.lora_int_id, lora_path=request.lora_path)


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, get_engine: Callable[[], AsyncEngine | None], allow_runtime_lora_updating: bool) -> None:
        self._get_engine, self.allow_updates = get_engine, allow_runtime_lora_updating

    async def _engine(self, context, updating: bool) -> AsyncEngine:
        engine = self._get_engine()
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        if not engine.lora_enabled:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "LoRA is not enabled on this server (start it with --enable-lora)")
        if updating and not self.allow_updates:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, RUNTIME_UPDATES_OFF)
        return engine

    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest, context):
        engine = await self._engine(context, updating=True)
        if not request.lora_name or not request.lora_path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name and lora_path are both required")
        try:
            loaded = await engine.load_lora_adapter(request.lora_name, request.lora_path)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return adapter_message(loaded)

    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest, context):
        engine = await self._engine(context, updating=True)
        try:
            engine.unload_lora_adapter(request.lora_name)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {request.lora_name[:200]!r} is not loaded")
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.UnloadLoRAAdapterResponse()

    async def ListLoRAAdapters(self, request: pb.ListLoRAAdaptersRequest, context):
        engine = await self._engine(context, updating=False)
        return pb.ListLoRAAdaptersResponse(adapters=[adapter_message(r) for r in engine.lora_adapters()])
