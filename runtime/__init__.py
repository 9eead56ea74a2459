"""pagedserve.runtime: the engine (block pool, scheduler, model runner, sampler) and the offline API.

`from pagedserve.runtime import LLM, SamplingParams`. Names are imported on first use, so importing
one small module (say, the block pool) does not load the whole model stack.
"""

from __future__ import annotations

import importlib
from typing import Any

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)

_EXPORTS = {
    "LLM": ".llm",
    "LLMEngine": ".engine.llm_engine",
    "EngineConfig": ".config",
    "SamplingParams": ".sampling_params",
    "StructuredOutputsParams": ".structured_outputs_params",
    "BeamSearchParams": ".core.beam_search",
    "RequestOutput": ".outputs",
    "CompletionOutput": ".outputs",
    "EngineStats": ".outputs",
    "LoRARequest": ".lora.request",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedserve.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
