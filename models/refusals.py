"""What the loaders refuse: config keys and GGUF metadata that change the math and are not implemented, and
checkpoint tensors the model would not use.

A model run with a key ignored gives wrong tokens from the first one on, with nothing to say why; so every key
a family's transformers modeling reads that changes the forward is either implemented (models/config.py reads
it into ModelConfig) or refused here, with a ValueError naming the key and its value (config_from_hf_dict adds
the file and the architecture). docs/models.md lists, per family, the keys honoured and the ones refused.

    key                           families (those whose transformers modeling reads it)   refused when
    attention_bias                qwen3, gemma3 (bias on q, k, v and o_proj; Llama's runs)  true
    mlp_bias                      llama (bias on gate, up, down)                          true
    partial_rotary_factor         all (rotary on part of each head; also in rope_*)       != 1
    quantization_config           all (packed GPTQ / AWQ / FP8 / bitsandbytes weights)    present
    attn_logit_softcapping,
    final_logit_softcapping       gemma3                                                  not null
    use_bidirectional_attention   gemma3 (an encoder)                                     true
    hidden_act / hidden_activation  all: silu for the Llama block, gelu_pytorch_tanh for Gemma 3; others refused

Unknown rope types are refused where they are read (config._rope_from_hf). The tensors: `check_tensors` refuses a
checkpoint with tensors the shape table does not name (biases of a bias-free config, say), an untied config
without lm_head.weight, and a tied one whose lm_head.weight is not the embedding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import registry

if TYPE_CHECKING:
    from .config import ModelConfig
    from .tensor_parallel import TPShard

_ALL = None  # every family

# key -> (families that read it, whether a value is one we run, what the key does)
REFUSED_KEYS: dict[str, tuple[frozenset[str] | None, Callable[[Any], bool], str]] = {
    "attention_bias": (frozenset({"qwen3", "gemma3"}), lambda v: not v, "a bias on q, k, v and o_proj"),
    "mlp_bias": (frozenset({"llama"}), lambda v: not v, "a bias on gate_proj, up_proj and down_proj"),
    "partial_rotary_factor": (_ALL, lambda v: v is None or float(v) == 1.0, "rotary on part of each head"),
    "quantization_config": (_ALL, lambda v: v is None, "quantized weights"),
    "attn_logit_softcapping": (frozenset({"gemma3"}), lambda v: v is None, "soft-capped attention scores"),
    "final_logit_softcapping": (frozenset({"gemma3"}), lambda v: v is None, "soft-capped logits"),
    "use_bidirectional_attention": (frozenset({"gemma3"}), lambda v: not v, "bidirectional attention (an encoder)"),
}

# The gated MLP's activation each family's model class computes (transformers' ACT2FN names).
HIDDEN_ACTS = {"gemma3": ("gelu_pytorch_tanh",)}
DEFAULT_ACTS = ("silu",)


def refused(key: str, value: Any, what: str) -> ValueError:
    return ValueError(f"config key {key}={value!r} is not supported ({what}); pagedserve refuses a model it would "
                      f"run wrongly")


def check_hf_keys(family: str, cfg: dict[str, Any]) -> None:
    """Raise ValueError naming the first key of config.json (or of its rope_parameters / rope_scaling) that
    changes this family's math in a way not implemented."""
    for key, (families, runs, what) in REFUSED_KEYS.items():
        if families is not None and family not in families:
            continue
        for where, d in _places(cfg):
            if key in d and not runs(d[key]):
                value = d[key]
                if key == "quantization_config" and isinstance(value, dict):
                    value = {"quant_method": value.get("quant_method")}
                raise refused(where + key, value, what)


def _places(cfg: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """config.json and the rope dicts in it (Gemma 3's rope_parameters hold one per layer type), with their
    prefixes for a message."""
    out = [("", cfg)]
    for name in ("rope_parameters", "rope_scaling"):
        d = cfg.get(name)
        if isinstance(d, dict):
            out.append((name + ".", d))
            out += [(f"{name}.{k}.", v) for k, v in d.items() if isinstance(v, dict)]
    return out


def check_hidden_act(family: str, act: str, key: str = "hidden_act") -> None:
    allowed = HIDDEN_ACTS.get(family, DEFAULT_ACTS)
    if act not in allowed:
        raise refused(key, act, f"the {family} model computes {' or '.join(allowed)}")


def check_gguf_metadata(arch: str, family: str, value: Callable[..., Any], head_dim: int) -> dict[str, Any]:
    """The same facts as config.json's, where GGUF metadata carries them: refused when not implemented; returns
    the ModelConfig fields they give (a linear rope scaling)."""
    def gguf_refused(key: str, v: Any, what: str) -> ValueError:
        return ValueError(f"GGUF metadata {arch}.{key}={v!r} is not supported ({what}); pagedserve refuses a model "
                          f"it would run wrongly")

    rope_dims = value(f"{arch}.rope.dimension_count", None)
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise gguf_refused("rope.dimension_count", int(rope_dims), f"rotary on part of each head of {head_dim}")
    key_len, value_len = value(f"{arch}.attention.key_length", None), value(f"{arch}.attention.value_length", None)
    if key_len is not None and value_len is not None and int(key_len) != int(value_len):
        raise gguf_refused("attention.value_length", int(value_len), f"values wider or narrower than keys ({key_len})")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        v = value(f"{arch}.{key}", None)
        if v:
            raise gguf_refused(key, float(v), "soft-capping")
    experts = value(f"{arch}.expert_count", None)
    if experts:
        raise gguf_refused("expert_count", int(experts), "a mixture of experts")
    fields: dict[str, Any] = {}
    kind = value(f"{arch}.rope.scaling.type", None)
    if family == "gemma3" or kind in (None, "none"):  # Gemma 3's own fields read it (registry.py)
        return fields
    if family == "phi3":  # LongRoPE, from the context lengths (registry.phi3_gguf_fields)
        if kind not in ("longrope", "su"):
            raise gguf_refused("rope.scaling.type", kind, "Phi-3 runs longrope")
        return fields
    if kind != "linear":
        raise gguf_refused("rope.scaling.type", kind, "implemented: none, linear; llama3 comes as rope_freqs")
    factor = value(f"{arch}.rope.scaling.factor", None)
    if factor:
        fields["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return fields


# Tensors a loader may hand the model beside the shape table's: GGUF blocks of a quantized weight, llama.cpp's
# rope factors (llama3's rope_freqs, LongRoPE's rope_factors_*).
_AUXILIARY = ("rope_freqs", "rope_factors_short", "rope_factors_long")
_QUANT_SUFFIXES = tuple(f".q{b}.{part}" for b in (4, 8) for part in ("qs", "scales", "mins"))
# What transformers skips when loading (older Llama checkpoints saved rotary's inv_freq buffer).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def check_tensors(config: ModelConfig, weights: dict[str, np.ndarray], source: str,
                  shard: TPShard | None = None) -> None:
    """Refuse a checkpoint that holds more than the model uses, or whose lm_head contradicts tie_word_embeddings.
    A tied checkpoint that stores lm_head.weight equal to the embedding loses it (in place), as do the buffers
    transformers ignores."""
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    if config.tie_word_embeddings and head in weights:
        if embed in weights and np.array_equal(weights[head], weights[embed]):
            del weights[head]
        else:
            raise ValueError(f"{source}: config key tie_word_embeddings=True, but the checkpoint's {head} is not "
                             f"{embed}; pagedserve refuses a model it would run wrongly")
    expected = registry.expected_shapes(config, shard)
    if [n for n in expected if n not in weights] == [head]:  # (other missing tensors: check_weights names them)
        raise ValueError(f"{source}: config key tie_word_embeddings=False (the default when config.json omits it), "
                         f"but the checkpoint has no {head}; pagedserve refuses a model it would run wrongly")
    for name in [n for n in weights if n.endswith(_IGNORED_SUFFIXES)]:
        del weights[name]
    unused = sorted(n for n in weights if n not in expected and n not in _AUXILIARY
                    and not n.endswith(_QUANT_SUFFIXES))
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise ValueError(f"{source}: {len(unused)} tensor(s) this {config.architecture} config does not use: "
                         f"{', '.join(map(repr, unused[:3]))}{more} (a config key the model does not implement, or "
                         f"another model's checkpoint); pagedserve refuses a model it would run wrongly")
