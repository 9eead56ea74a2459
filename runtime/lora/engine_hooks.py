"""Where the engine meets LoRA: the manager built and wired at start, a request's adapter checked before queueing."""

from __future__ import annotations

from typing import Any

from .manager import LoRAManager
from .request import LoRARequest


def make_lora_manager(config: Any, model: Any, scheduler: Any, runner: Any) -> LoRAManager | None:
    """enable_lora: the manager over the model's slots (models/lora.py attach, done by the worker), the scheduler's
    admission condition and release hook, and the runner's slot lookup; None when LoRA is off. A speculative draft
    model has no slots: it drafts with the base weights, and the verify step runs with the adapter (exact)."""
    if not config.enable_lora:
        return None
    manager = LoRAManager(model.lora, model.config, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
    scheduler.lora = manager
    scheduler.release_hooks.append(manager.release)
    runner.lora = manager
    return manager


def check_lora_request(manager: LoRAManager | None, lora_request: LoRARequest | None) -> None:
    """ValueError unless the engine serves `lora_request` (LoRA on, the name registered with this very request)."""
    if lora_request is None:
        return
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
    if manager is None:
        raise ValueError(f"lora_request {lora_request.lora_name!r}: LoRA is not enabled (start with enable_lora=True)")
    known = manager.get(lora_request.lora_name)
    if known is None:
        raise ValueError(f"LoRA adapter {lora_request.lora_name!r} is not loaded")
    if known != lora_request:
        raise ValueError(f"LoRA adapter {lora_request.lora_name!r} is loaded with id {known.lora_int_id} and path "
                         f"{known.lora_path}, not {lora_request.lora_int_id} and {lora_request.lora_path}")


def register_lora_request(manager: LoRAManager | None, lora_request: LoRARequest | None) -> None:
    """The offline API's way (vLLM's LLM.generate): an adapter named for the first time is read and registered;
    then checked as check_lora_request does."""
    if manager is not None and isinstance(lora_request, LoRARequest):
        manager.register(lora_request)
    check_lora_request(manager, lora_request)
