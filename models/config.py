"""ModelConfig: the few numbers a decoder's forward pass needs, from HF config.json or GGUF metadata.

The Llama block's numbers come first; the fields after `rope_scaling` are what other families add (Gemma 3's
sliding-window layers, their own rope base, `query_pre_attn_scalar`, the MLP's activation). Each family's own
keys are read by `_FAMILY_FIELDS[family]` below.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import refusals, registry


ROPE_TYPES = ("default", "llama3", "longrope", "linear")
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a models/registry.py family name: "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3"
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
    # {"rope_type": "llama3" | "longrope" | "linear", ...} (models/rope.py), or None for plain rope
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # Sliding-window attention: layer n reads only the last `sliding_window` keys when layer_types[n] is
    # "sliding_attention" (empty layer_types: every layer is "full_attention").
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # the sliding layers' rope base (Gemma 3), else rope_theta
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma), else head_dim ** -0.5
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    o_proj_bias: bool = False  # o_proj carries a bias (Llama's attention_bias, with q/k/v's: attention_bias)
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
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ROPE_TYPES:
            raise ValueError(f"model config: unsupported rope scaling {self.rope_scaling.get('rope_type')!r}")
        # a list when read back from JSON; longer than the layers in a draft made of the target's first layers
        object.__setattr__(self, "layer_types", tuple(self.layer_types)[: self.num_hidden_layers])
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"model config: layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"model config: unknown layer_types {unknown} (supported: {list(LAYER_TYPES)})")
        if "sliding_attention" in self.layer_types and (
                not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"model config: sliding_window must be a positive integer for sliding_attention "
                             f"layers, got {self.sliding_window!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"model config: unsupported hidden_act {self.hidden_act!r} "
                             f"(supported: {list(HIDDEN_ACTS)})")

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends over a sliding window (config.sliding_window keys) rather than all keys."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        """The window of layer `layer`: `sliding_window` for a sliding layer, None for a full one."""
        return self.sliding_window if self.is_sliding(layer) else None

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


def _rope_from_hf(cfg: dict[str, Any], params: dict[str, Any] | None = None,
                  default_theta: float = 10000.0) -> tuple[float, dict[str, Any] | None]:
    """rope theta and scaling, whether at the top level (transformers 4) or under rope_parameters (5); `params`:
    one layer type's entry of a per-layer-type rope_parameters (Gemma 3)."""
    if params is None:
        params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = params.get("rope_theta", cfg.get("rope_theta", default_theta))
    rope_type = params.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if rope_type == "su":  # Phi-3's first name for longrope
        rope_type = "longrope"
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type not in ROPE_TYPES:
        key = "rope_parameters" if params.get("rope_type") else "rope_scaling"
        key += ".rope_type" if (params or scaling or {}).get("rope_type") else ".type"
        raise ValueError(f"unsupported rope scaling type {rope_type!r}: config key {key}={rope_type!r} is not "
                         f"supported (implemented: {', '.join(ROPE_TYPES)}); pagedserve refuses a model it would "
                         f"run wrongly")
    source = params if params.get("rope_type") in (rope_type, "su") else scaling
    keys = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "linear": ("factor",), "longrope": ("short_factor", "long_factor")}[rope_type]
    missing = [k for k in keys if k not in source]
    if missing:
        raise ValueError(f"{rope_type} rope scaling is missing {missing}")
    out = {"rope_type": rope_type, **{k: source[k] for k in keys}}
    if rope_type == "longrope":
        out.update(_longrope_extras(cfg, source))
    return float(theta), out


def _longrope_extras(cfg: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's pretraining length and cos/sin factor, as transformers derives them: the factor defaults to
    sqrt(1 + ln(s) / ln(original)), s = max_position_embeddings / original_max_position_embeddings."""
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    original = int(source.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or max_pos)
    factor = source.get("factor") or max_pos / original
    attention_factor = source.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"original_max_position_embeddings": original, "attention_factor": float(attention_factor)}


def _sliding_layers(cfg: dict[str, Any]) -> dict[str, Any]:
    """layer_types and sliding_window when config.json names sliding layers (Qwen3 with use_sliding_window), as
    transformers reads them: its window only with use_sliding_window, and without layer_types the layers from
    max_window_layers on."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    types = tuple(cfg.get("layer_types") or ())
    if not types and window is not None:
        first = int(cfg.get("max_window_layers", 28))
        types = tuple("sliding_attention" if i >= first else "full_attention"
                      for i in range(int(cfg["num_hidden_layers"])))
    if "sliding_attention" not in types or window is None:
        return {}
    return {"layer_types": types, "sliding_window": window}


def _llama_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama's attention_bias: a bias on q, k, v and o_proj (transformers' LlamaAttention)."""
    return {"attention_bias": True, "o_proj_bias": True} if cfg.get("attention_bias") else {}


def _qwen3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3's sliding layers, and its head_dim of 128 when config.json omits it (transformers' default)."""
    return {**_sliding_layers(cfg), "head_dim": int(cfg.get("head_dim") or 128)}


def _window_on_every_layer(cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 and Mistral apply their sliding_window (2047 in Phi-3-mini-4k, 4096 in Mistral-7B-v0.1; null in
    the later ones) to every layer, as transformers does."""
    window = cfg.get("sliding_window")
    if window is None:
        return {}
    return {"layer_types": ("sliding_attention",) * int(cfg["num_hidden_layers"]), "sliding_window": window}


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 (text): local layers with their own rope base and a window, query_pre_attn_scalar, GELU-tanh.
    transformers 5 writes rope_parameters per layer type; older configs rope_theta + rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        theta, scaling = _rope_from_hf({}, params["full_attention"], default_theta=1e6)
        local_theta, local_scaling = _rope_from_hf({}, params.get("sliding_attention") or {}, default_theta=1e4)
        if local_scaling is not None:
            raise ValueError(f"Gemma 3: rope scaling on the sliding layers ({local_scaling['rope_type']}) "
                             f"is not supported")
    else:
        theta, scaling = _rope_from_hf(cfg, default_theta=1e6)
        local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    layers = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern", 6))
    types = tuple(cfg.get("layer_types") or ("sliding_attention" if (i + 1) % pattern else "full_attention"
                                             for i in range(layers)))
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta, "layer_types": types,
            "sliding_window": cfg.get("sliding_window", 4096),
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
            "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
            "head_dim": int(cfg.get("head_dim", 256)),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))}


# What a family reads from config.json beyond the Llama block's keys (its values win over the common ones).
_FAMILY_FIELDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "llama": _llama_fields, "qwen2": _sliding_layers, "qwen3": _qwen3_fields, "phi3": _window_on_every_layer,
    "mistral": _window_on_every_layer, "gemma3": _gemma3_fields,
}


def config_from_hf_dict(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    archs = cfg.get("architectures") or []
    entry = next((e for e in map(registry.find_hf, archs) if e is not None), None)
    if entry is None:
        raise ValueError(
            f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {registry.supported_hf()}"
        )
    try:
        refusals.check_hf_keys(entry.name, cfg)
        family = _FAMILY_FIELDS.get(entry.name, lambda _: {})(cfg)
        theta, scaling = (None, None) if "rope_theta" in family else _rope_from_hf(cfg)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        act = cfg.get("hidden_act") or "silu"
        fields = dict(
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
            # Qwen2 always has q/k/v bias (its entry's flag); Llama's attention_bias: _llama_fields.
            attention_bias=entry.qkv_bias,
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=str(cfg.get("_name_or_path", "")),
            hidden_act=act,
        )
        fields.update(family)
        act_key = "hidden_activation" if cfg.get("hidden_activation") and entry.name == "gemma3" else "hidden_act"
        refusals.check_hidden_act(entry.name, fields["hidden_act"], act_key)
        return ModelConfig(**fields)
    except KeyError as e:
        raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source} ({entry.hf_names[0]}): {e}") from None


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
