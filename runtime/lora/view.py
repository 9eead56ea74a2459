"""What the server reads and changes of the engine's adapters (EngineView's LoRA part): look a name up, list,
load (the disk read off the event loop) and unload. Safe from the event loop: the manager locks its dicts."""

from __future__ import annotations

from typing import Any

import anyio

from .manager import LoRAStats
from .request import LoRARequest


class LoRAView:
    engine: Any  # the LLMEngine

    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora is not None

    def lora_request(self, name: str) -> LoRARequest | None:
        """The adapter registered as `name`, or None (also when LoRA is off)."""
        return self.engine.lora.get(name) if self.engine.lora is not None else None

    def lora_adapters(self) -> list[LoRARequest]:
        return self.engine.lora.list() if self.engine.lora is not None else []

    def lora_stats(self) -> LoRAStats | None:
        return self.engine.lora.stats() if self.engine.lora is not None else None

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """Read the adapter at `path` in a worker thread and register it as `name` (a new lora_int_id);
        ValueError naming the problem (LoRA off, the name taken, a bad adapter)."""
        manager = self._lora_manager()
        if manager.get(name) is not None:
            raise ValueError(f"LoRA adapter {name!r} is already loaded; unload it first")
        request = LoRARequest(name, max([r.lora_int_id for r in manager.list()], default=0) + 1, path)
        adapter = await anyio.to_thread.run_sync(manager.read, request)
        manager.register(request, adapter)
        return request

    def unload_lora_adapter(self, name: str) -> None:
        """KeyError: no such adapter; ValueError: LoRA off, or running requests hold it."""
        self._lora_manager().remove(name)

    def _lora_manager(self) -> Any:
        if self.engine.lora is None:
            raise ValueError("LoRA is not enabled on this server (start it with --enable-lora)")
        return self.engine.lora
