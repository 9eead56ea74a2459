"""LoRA adapters in the PEFT format: a directory with `adapter_config.json` and `adapter_model.safetensors`.

    adapter_config.json         {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_rslora": false,
                                 "target_modules": ["q_proj", "v_proj"], ...}
    adapter_model.safetensors   base_model.model.model.layers.{n}.self_attn.q_proj.lora_A.weight  [r, in]
                                base_model.model.model.layers.{n}.self_attn.q_proj.lora_B.weight  [out, r]

A targeted linear y = x W^T becomes y + scale * (x A^T) B^T, scale = lora_alpha / r (rsLoRA: lora_alpha /
sqrt(r)). Only the seven projections of a Llama-family block are served (q/k/v/o, gate/up/down); the model
fuses q/k/v and gate/up (models/llama.py), and models/lora.py stacks the parts' A and B to match. Whatever
changes the math in a way we do not serve is refused with its name (modules_to_save, DoRA, biases,
per-module rank or alpha patterns, fan_in_fan_out), never ignored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from .safetensors_io import read_safetensors

# PEFT's module names, in the order the model's fused weights hold their rows.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    """One adapter's weights as float32, keyed by (layer, module): A [r, in], B [out, r]."""

    path: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.lora_alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def target_modules(self) -> tuple[str, ...]:
        present = {m for _, m in self.weights}
        return tuple(m for m in TARGET_MODULES if m in present)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of a projection of the (unsharded) model."""
    q, kv, h, i = (config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim,
                   config.hidden_size, config.intermediate_size)
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}[module]


def _read_config(path: Path) -> dict:
    cfg_path = path / "adapter_config.json"
    if not path.exists():
        raise ValueError(f"LoRA adapter {path}: directory not found")
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {path}: not a directory")
    if not cfg_path.is_file():
        raise ValueError(f"LoRA adapter {path}: adapter_config.json not found")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {path}: adapter_config.json must hold a JSON object")
    return cfg


def _check_config(cfg: dict, where: str) -> tuple[int, float, bool]:
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not served (only LORA)")
    if cfg.get("use_dora"):
        raise ValueError(f"{where}: use_dora (DoRA) is not supported")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save {cfg['modules_to_save']!r} is not supported (only LoRA deltas "
                         f"on the linear layers are served)")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias {cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"{where}: fan_in_fan_out is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"{where}: {key} is not supported (one rank and alpha for every module)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"{where}: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"{where}: lora_alpha must be a positive number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in TARGET_MODULES]
        if unknown:
            raise ValueError(f"{where}: target_modules {unknown} are not layers this model has (served: "
                             f"{', '.join(TARGET_MODULES)})")
    return r, float(alpha), bool(cfg.get("use_rslora", False))


def load_peft_adapter(path: str | Path, config: ModelConfig, max_lora_rank: int | None = None) -> LoRAAdapter:
    """Read and check a PEFT LoRA directory against the base model's config; ValueError naming the problem."""
    path = Path(path)
    where = f"LoRA adapter {path}"
    cfg = _read_config(path)
    rank, alpha, rslora = _check_config(cfg, where)
    if max_lora_rank is not None and rank > max_lora_rank:
        raise ValueError(f"{where}: rank r={rank} exceeds max_lora_rank={max_lora_rank}")
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        bin_file = (path / "adapter_model.bin").exists()
        hint = " (adapter_model.bin is not read: save with safetensors)" if bin_file else ""
        raise ValueError(f"{where}: adapter_model.safetensors not found{hint}")
    try:
        tensors = read_safetensors(file)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, t in tensors.items():
        m = _KEY.match(name)
        if m is None:
            raise ValueError(f"{where}: tensor {name!r} is not a LoRA A/B weight of a layer this model has "
                             f"(served: {', '.join(TARGET_MODULES)})")
        layer, block, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in TARGET_MODULES or (block == "mlp") != (module in MLP_MODULES):
            raise ValueError(f"{where}: tensor {name!r} targets {block}.{module}, a module this model lacks")
        if layer >= config.num_hidden_layers:
            raise ValueError(f"{where}: tensor {name!r} names layer {layer}; the model has "
                             f"{config.num_hidden_layers}")
        parts.setdefault((layer, module), {})[ab] = t
    if not parts:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    adapter = LoRAAdapter(str(path), rank, alpha, rslora)
    for (layer, module), ab in sorted(parts.items()):
        key = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: {key} has lora_{''.join(ab)} but not lora_{'B' if 'A' in ab else 'A'}")
        out, inp = module_shape(config, module)
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, inp) or b.shape != (out, rank):
            raise ValueError(f"{where}: {key} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the "
                             f"model expects ({rank}, {inp}) and ({out}, {rank}) (r={rank})")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise ValueError(f"{where}: {key} holds inf or NaN")
        adapter.weights[(layer, module)] = (np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32))
    return adapter
