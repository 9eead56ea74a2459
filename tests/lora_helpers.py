"""Helpers for the LoRA tests: scripts/make_lora.py imported by path, and small adapters on tests/data models."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DATA = Path(__file__).parent / "data"
_SCRIPT = Path(__file__).parents[1] / "scripts" / "make_lora.py"


def make_lora_module():
    spec = importlib.util.spec_from_file_location("make_lora_script", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_lora(out_dir, config, **kwargs) -> Path:
    """scripts/make_lora.make_lora: a random PEFT adapter for `config` in out_dir."""
    return make_lora_module().make_lora(out_dir, config, **kwargs)
