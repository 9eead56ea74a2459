"""Multi-LoRA serving: the adapter registry, execution slots, host LRU and loading off the event loop."""

from .request import LoRARequest

__all__ = ["LoRARequest"]
