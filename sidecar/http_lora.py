"""The HTTP API's LoRA routes, vLLM's: POST /v1/load_lora_adapter and /v1/unload_lora_adapter
({"lora_name", "lora_path"}), and the adapters' cards in GET /v1/models (`parent`: the base model).

Load and unload answer 404 unless the server runs with --allow-runtime-lora-updating (vLLM does not register
them without VLLM_ALLOW_RUNTIME_LORA_UPDATING); the disk read of a load runs in a worker thread.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from pagedserve.runtime.engine.async_engine import AsyncEngine

from .http_models import ApiError


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name is what counts


def adapter_cards(engine: AsyncEngine, base: str, created: int) -> list[dict]:
    return [{"id": r.lora_name, "object": "model", "created": created, "owned_by": "pagedserve",
             "root": r.lora_path, "parent": base} for r in engine.lora_adapters()]


def lora_for_model(engine: AsyncEngine, name: str | None, base: str):
    """The LoRARequest the OpenAI `model` field names (None: the base); 404 for a name that is neither."""
    if name is None or name == base:
        return None
    lora = engine.lora_request(name)
    if lora is None:
        served = ", ".join([repr(base)] + [repr(r.lora_name) for r in engine.lora_adapters()])
        raise ApiError(404, f"model {name[:200]!r} does not exist; this server serves {served}", "model",
                       "model_not_found")
    return lora


class LoRARoutes:
    def __init__(self, allow_runtime_lora_updating: bool) -> None:
        self.allow = allow_runtime_lora_updating

    def _check(self, engine: AsyncEngine) -> None:
        if not self.allow:
            raise ApiError(404, "runtime LoRA updates are off: start the server with --allow-runtime-lora-updating",
                           None, "not_found")
        if not engine.lora_enabled:
            raise ApiError(400, "LoRA is not enabled on this server (start it with --enable-lora)", None,
                           "lora_disabled")

    async def load(self, engine: AsyncEngine, body: LoadLoRAAdapterRequest) -> str:
        self._check(engine)
        if not body.lora_name or not body.lora_path:
            raise ApiError(400, "lora_name and lora_path are both required", "lora_name", "invalid_value")
        try:
            await engine.load_lora_adapter(body.lora_name, body.lora_path)
        except ValueError as e:
            raise ApiError(400, str(e), "lora_path", "invalid_value") from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, engine: AsyncEngine, body: UnloadLoRAAdapterRequest) -> str:
        self._check(engine)
        try:
            engine.unload_lora_adapter(body.lora_name)
        except KeyError:
            raise ApiError(404, f"LoRA adapter {body.lora_name[:200]!r} is not loaded", "lora_name",
                           "not_found") from None
        except ValueError as e:
            raise ApiError(400, str(e), "lora_name", "invalid_value") from None
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
