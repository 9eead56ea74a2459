"""ModelConfig: the few numbers a Llama-family forward pass needs, from HF config.json or GGUF metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import registry


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a models/registry.py family name: "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None  # only {"rope_type": "llama3", ...} is supported
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ("llama3", "default"):
            raise ValueError(f"model config: unsupported rope scaling {self.rope_scaling.get('rope_type')!r}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def matmul_flops_per_token(self) -> int:
        """FLOPs (2 per multiply-add) of one token through every layer's weight matmuls, logits not included."""
        return registry.matmul_flops_per_token(self)

    @property
    def attention_flops_per_key(self) -> int:
        """FLOPs one token spends on each key it attends to, all layers: Q.K^T and P.V, 2 per multiply-add each."""
        return 4 * self.q_size * self.num_hidden_layers


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope theta and scaling, whether at the top level (transformers 4) or under rope_parameters (5)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, llama3)")
    source = params if params.get("rope_type") == "llama3" else scaling
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in source]
    if missing:
        raise ValueError(f"llama3 rope scaling is missing {missing}")
    return float(theta), {"rope_type": "llama3", **{k: source[k] for k in keys}}


def config_from_hf_dict(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    archs = cfg.get("architectures") or []
    entry = next((e for e in map(registry.find_hf, archs) if e is not None), None)
    if entry is None:
        raise ValueError(
            f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {registry.supported_hf()}"
        )
    try:
        theta, scaling = _rope_from_hf(cfg)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            architecture=entry.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias (its entry's flag); Llama/Mistral only when attention_bias says so.
            attention_bias=entry.qkv_bias or bool(cfg.get("attention_bias", False)),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=str(cfg.get("_name_or_path", "")),
        )
    except KeyError as e:
        raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None


def load_hf_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: not found (an HF model directory needs config.json)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config_from_hf_dict(cfg, source=str(path))
