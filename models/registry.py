"""The model registry: one entry per architecture, and everything that follows from its shape table.

An `Architecture` says how a family is named (Hugging Face `architectures`, GGUF `general.architecture`),
how GGUF tensor names map to Hugging Face ones and whether llama.cpp permuted the q/k rows, which config
flags it forces (Qwen2's q/k/v bias), which class runs it (imported only when asked for, so that
models/config.py stays light), and one shape table: the tensors of one layer and the global ones, as
functions of the config. Expected shapes (the loaders' checks), weight bytes (the memory budget and the
GPU KV sizing) and matmul FLOPs per token (the scheduler and the benches) are all derived from it here.

A new family is one `register(Architecture(...))` below plus the layers its model class needs:

    family   model class                     beyond the Llama block
    llama    llama.LlamaForCausalLM          (Llama 3.x: llama3 rope, tied embeddings in 3.2)
    mistral  llama.LlamaForCausalLM          GGUF files say "llama"
    qwen2    llama.LlamaForCausalLM          q/k/v bias
    phi3     llama.LlamaForCausalLM          fused qkv_proj and gate_up_proj (split at load), LongRoPE
    qwen3    qwen3.Qwen3ForCausalLM          RMSNorm of each q and k head before rotary (qk-norm)
    gemma3   gemma3.Gemma3ForCausalLM        four norms a layer of (1 + w) (folded at load), qk-norm, GELU-tanh,
                                             embedding times sqrt(hidden), sliding-window layers with their own
                                             rope base, query_pre_attn_scalar
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:  # the registry is imported by models/config.py: no runtime import back
    from .config import ModelConfig
    from .tensor_parallel import TPShard

Shape = tuple[int, ...]
ShapeTable = Callable[["ModelConfig"], dict[str, Shape]]


@dataclass(frozen=True)
class Architecture:
    name: str  # our family name, ModelConfig.architecture
    hf_names: tuple[str, ...]  # config.json `architectures` entries
    gguf_name: str | None  # GGUF general.architecture (None: the family's files carry another entry's name)
    model_class_path: str  # "module:Class", imported on first use
    layer_shapes: ShapeTable  # one layer's tensors: leaf name (after "model.layers.N.") -> shape
    global_shapes: ShapeTable  # the tensors outside the layers: full name -> shape
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)  # "attn_q" -> "self_attn.q_proj"
    gguf_global_names: Mapping[str, str] = field(default_factory=dict)  # "token_embd.weight" -> HF name
    gguf_qk_permuted: bool = False  # llama.cpp interleaved the q/k rows (gguf_loader.unpermute_qk undoes it)
    qkv_bias: bool = False  # q/k/v always carry a bias (else only when config.json's attention_bias says so)
    # What the loaders do to the checkpoint's full tensors before slicing and checking them (Phi-3's fused
    # matrices split, Gemma's (1 + w) norms folded): fn(config, weights, fmt) with fmt "hf" or "gguf", in place.
    load_transform: Callable[[ModelConfig, dict[str, Any], str], None] | None = None
    # GGUF metadata beyond the Llama block's keys: fn(arch, value(key, default)) -> ModelConfig fields.
    gguf_config_fields: Callable[[str, Callable[[str, Any], Any]], dict[str, Any]] | None = None
    # Checkpoint tensors the loader splits (load_transform): read whole by a tensor-parallel rank, then sliced.
    fused_names: tuple[str, ...] = ()

    @property
    def model_class(self) -> Any:
        """The class that runs this family: `model_class(config, weights, backend, source=, shard=, comm=)`."""
        module, _, cls = self.model_class_path.partition(":")
        return getattr(importlib.import_module(module), cls)


_ENTRIES: dict[str, Architecture] = {}


def register(entry: Architecture) -> Architecture:
    taken = {n for e in _ENTRIES.values() for n in e.hf_names}
    if entry.name in _ENTRIES or taken & set(entry.hf_names) or (
            entry.gguf_name is not None and any(e.gguf_name == entry.gguf_name for e in _ENTRIES.values())):
        raise ValueError(f"model registry: {entry.name!r} clashes with an existing entry")
    _ENTRIES[entry.name] = entry
    return entry


def supported() -> dict[str, Architecture]:
    """Every entry, by family name."""
    return dict(_ENTRIES)


def supported_hf() -> list[str]:
    return sorted(n for e in _ENTRIES.values() for n in e.hf_names)


def supported_gguf() -> list[str]:
    return sorted(e.gguf_name for e in _ENTRIES.values() if e.gguf_name is not None)


def find_hf(name: str) -> Architecture | None:
    return next((e for e in _ENTRIES.values() if name in e.hf_names), None)


def lookup_hf(name: str, source: str = "config.json") -> Architecture:
    """The entry of HF architecture `name`; ValueError naming it and the supported ones otherwise."""
    entry = find_hf(name)
    if entry is None:
        raise ValueError(f"{source}: unsupported architecture {name!r}; supported: {supported_hf()}")
    return entry


def lookup_gguf(name: str, source: str = "GGUF file") -> Architecture:
    """The entry of GGUF architecture `name`; ValueError naming it and the supported ones otherwise."""
    entry = next((e for e in _ENTRIES.values() if e.gguf_name is not None and e.gguf_name == name), None)
    if entry is None:
        raise ValueError(f"{source}: unsupported GGUF architecture {name!r}; supported: {supported_gguf()}")
    return entry


def for_config(config: ModelConfig) -> Architecture:
    """The entry behind a loaded config (ModelConfig.architecture is the family name)."""
    entry = _ENTRIES.get(config.architecture)
    if entry is None:
        raise ValueError(f"unsupported model architecture {config.architecture!r}; supported: {sorted(_ENTRIES)}")
    return entry


# -- what the shape table gives -----------------------------------------------------------------

LAYER_PREFIX = "model.layers.{}."


def expected_shapes(config: ModelConfig, shard: TPShard | None = None) -> dict[str, Shape]:
    """Every tensor the model needs, with its shape (Hugging Face names); a tensor-parallel rank's slices
    when `shard` is given."""
    entry = for_config(config)
    shapes = dict(entry.global_shapes(config))
    layer = entry.layer_shapes(config)
    for n in range(config.num_hidden_layers):
        p = LAYER_PREFIX.format(n)
        shapes.update({p + leaf: shape for leaf, shape in layer.items()})
    if shard is not None and shard.is_sharded:
        shapes = {name: shard.shard_shape(config, name, shape) for name, shape in shapes.items()}
    return shapes


def check_weights(config: ModelConfig, weights: Mapping[str, Any], source: str, shard: TPShard | None = None) -> None:
    """Raise ValueError naming `source` and the tensor when a weight is missing or mis-shaped."""
    for name, shape in expected_shapes(config, shard).items():
        if name not in weights:
            raise ValueError(f"{source}: missing tensor {name!r}")
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(weights[name].shape)}, "
                             f"expected {shape} from the model config")


def weight_bytes(config: ModelConfig, itemsize: int, shard: TPShard | None = None) -> int:
    """Bytes of the weights at `itemsize` per value (a tied lm_head is the embedding: counted once);
    a tensor-parallel rank's share with `shard`."""
    return sum(prod(shape) for shape in expected_shapes(config, shard).values()) * itemsize


def matmul_flops_per_token(config: ModelConfig) -> int:
    """FLOPs (2 per multiply-add) of one token through every layer's weight matmuls (the table's 2-D
    tensors), logits not included."""
    layer = for_config(config).layer_shapes(config)
    return config.num_hidden_layers * sum(2 * prod(s) for s in layer.values() if len(s) == 2)


# -- the Llama block (Llama, Mistral, Qwen2) ------------------------------------------------------

def llama_layer_shapes(config: ModelConfig) -> dict[str, Shape]:
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    shapes = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    if config.attention_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                       "self_attn.v_proj.bias": (kv,)})
    if config.o_proj_bias:
        shapes["self_attn.o_proj.bias"] = (h,)
    return shapes


def llama_global_shapes(config: ModelConfig) -> dict[str, Shape]:
    h = config.hidden_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


# llama.cpp's names of the Llama block's tensors (blk.N.<key>.weight|bias) and of the global ones.
LLAMA_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LLAMA_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # llama3 rope scaling's factors (optional; not in the shape table)
}

_LLAMA_BLOCK = dict(model_class_path="pagedserve.models.llama:LlamaForCausalLM", layer_shapes=llama_layer_shapes,
                    global_shapes=llama_global_shapes, gguf_layer_names=LLAMA_GGUF_LAYER_NAMES,
                    gguf_global_names=LLAMA_GGUF_GLOBAL_NAMES)

# llama.cpp's converter permutes q/k rows of Llama (its rope is GPT-J style there) and writes Mistral
# checkpoints as "llama" too; Qwen2's rope is NeoX style (rotate half), so its rows are left as they are.
LLAMA = register(Architecture(name="llama", hf_names=("LlamaForCausalLM",), gguf_name="llama",
                              gguf_qk_permuted=True, **_LLAMA_BLOCK))
MISTRAL = register(Architecture(name="mistral", hf_names=("MistralForCausalLM",), gguf_name=None,
                                gguf_qk_permuted=True, **_LLAMA_BLOCK))
QWEN2 = register(Architecture(name="qwen2", hf_names=("Qwen2ForCausalLM",), gguf_name="qwen2", qkv_bias=True,
                              **_LLAMA_BLOCK))


# -- Qwen3: the Llama block with per-head RMSNorm of q and k (qk-norm) -----------------------------

def qwen3_layer_shapes(config: ModelConfig) -> dict[str, Shape]:
    shapes = llama_layer_shapes(config)
    shapes.update({"self_attn.q_norm.weight": (config.head_dim,), "self_attn.k_norm.weight": (config.head_dim,)})
    return shapes


QK_NORM_GGUF_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

QWEN3 = register(Architecture(
    name="qwen3", hf_names=("Qwen3ForCausalLM",), gguf_name="qwen3",
    model_class_path="pagedserve.models.qwen3:Qwen3ForCausalLM", layer_shapes=qwen3_layer_shapes,
    global_shapes=llama_global_shapes, gguf_layer_names={**LLAMA_GGUF_LAYER_NAMES, **QK_NORM_GGUF_NAMES},
    gguf_global_names=LLAMA_GGUF_GLOBAL_NAMES))


# -- Phi-3: the Llama block stored with fused qkv_proj and gate_up_proj, LongRoPE --------------------

def split_phi3(config: ModelConfig, weights: dict[str, Any], fmt: str) -> None:
    """qkv_proj [q + 2 kv, h] -> q_proj, k_proj, v_proj; gate_up_proj [2 I, h] -> gate_proj, up_proj (in the
    GGUF file: attn_qkv and ffn_up, already renamed by the name map). Views, no copies. A GGUF file's block
    arrays of a fused weight (gguf_loader.quant_names: "<name>.q4.qs", ...) hold whole rows too: split alike."""
    q, kv, i = config.q_size, config.kv_size, config.intermediate_size
    for n in range(config.num_hidden_layers):
        p = LAYER_PREFIX.format(n)
        for fused, parts in ((p + "self_attn.qkv_proj.weight", (("q_proj", 0, q), ("k_proj", q, q + kv),
                                                                ("v_proj", q + kv, q + 2 * kv))),
                             (p + "mlp.gate_up_proj.weight", (("gate_proj", 0, i), ("up_proj", i, 2 * i)))):
            w = weights.pop(fused, None)
            if w is None:
                continue
            if w.shape[0] != parts[-1][2]:
                raise ValueError(f"tensor {fused!r} has {w.shape[0]} rows, expected {parts[-1][2]} from the config")
            module = fused.rsplit(".", 2)[0]
            for name, a, b in parts:
                weights[f"{module}.{name}.weight"] = w[a:b]
            for blocks in [n for n in weights if n.startswith(fused + ".")]:
                suffix, rows = blocks[len(fused):], weights.pop(blocks)
                for name, a, b in parts:
                    weights[f"{module}.{name}.weight{suffix}"] = rows[a:b]


def phi3_gguf_fields(arch: str, value: Callable[[str, Any], Any]) -> dict[str, Any]:
    """LongRoPE when the context outgrows the pretraining length (its factors are the file's rope_factors_short /
    rope_factors_long tensors, read by the model), and the sliding window on every layer, as llama.cpp does."""
    fields: dict[str, Any] = {}
    ctx = int(value(f"{arch}.context_length", 0))
    original = int(value(f"{arch}.rope.scaling.original_context_length", 0) or ctx)
    if ctx > original:
        attn = value(f"{arch}.rope.scaling.attn_factor", None)
        attn = math.sqrt(1 + math.log(ctx / original) / math.log(original)) if attn is None else float(attn)
        fields["rope_scaling"] = {"rope_type": "longrope", "short_factor": None, "long_factor": None,
                                  "original_max_position_embeddings": original, "attention_factor": attn}
    window = value(f"{arch}.attention.sliding_window", None)
    if window:
        fields.update(layer_types=("sliding_attention",) * int(value(f"{arch}.block_count", 0)),
                      sliding_window=int(window))
    return fields


PHI3 = register(Architecture(
    name="phi3", hf_names=("Phi3ForCausalLM",), gguf_name="phi3",
    model_class_path="pagedserve.models.llama:LlamaForCausalLM", layer_shapes=llama_layer_shapes,
    global_shapes=llama_global_shapes,
    gguf_layer_names={**LLAMA_GGUF_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    gguf_global_names={**LLAMA_GGUF_GLOBAL_NAMES, "rope_factors_long.weight": "rope_factors_long",
                       "rope_factors_short.weight": "rope_factors_short"},
    load_transform=split_phi3, gguf_config_fields=phi3_gguf_fields,
    fused_names=("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")))


# -- Gemma 3 (text): four norms a layer, qk-norm, GELU-tanh, sliding-window layers ----------------

def gemma3_layer_shapes(config: ModelConfig) -> dict[str, Shape]:
    h = config.hidden_size
    shapes = qwen3_layer_shapes(config)
    shapes.update({"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)})
    return shapes


GEMMA3_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
                "post_feedforward_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def fold_gemma_norms(config: ModelConfig, weights: dict[str, Any], fmt: str) -> None:
    """Gemma's RMSNorm multiplies by (1 + w): fold the 1 in, so the model runs the plain rms_norm op. llama.cpp's
    converter already did it in GGUF files."""
    if fmt == "gguf":
        return
    names = ["model.norm.weight"] + [LAYER_PREFIX.format(n) + leaf for n in range(config.num_hidden_layers)
                                     for leaf in GEMMA3_NORMS]
    for name in names:
        if name in weights:
            weights[name] = weights[name] + 1.0  # float32, as transformers computes 1.0 + weight.float()


def gemma3_gguf_fields(arch: str, value: Callable[[str, Any], Any]) -> dict[str, Any]:
    """What llama.cpp's gemma3 loader assumes: every 6th layer global, local rope base 10000, attention scale
    1/sqrt(head_dim) (its 27B: 1/sqrt(hidden / heads))."""
    layers = int(value(f"{arch}.block_count", 0))
    head_dim = int(value(f"{arch}.attention.key_length", 256))
    hidden, heads = int(value(f"{arch}.embedding_length", 0)), int(value(f"{arch}.attention.head_count", 1))
    scalar = hidden // heads if layers == 62 else head_dim  # llama.cpp's LLM_TYPE_27B: 62 layers
    # the global layers' linear rope scaling of the 4B, 12B and 27B (factor 8): gemma3.rope.scaling.*
    kind, factor = value(f"{arch}.rope.scaling.type", None), value(f"{arch}.rope.scaling.factor", None)
    if kind not in (None, "none", "linear"):
        raise ValueError(f"Gemma 3 GGUF with rope scaling {kind!r} is not supported (linear is)")
    scaling = {"rope_type": "linear", "factor": float(factor)} if kind == "linear" and factor else None
    types = tuple("sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers))
    return {"rope_scaling": scaling, "layer_types": types,
            "sliding_window": int(value(f"{arch}.attention.sliding_window", 4096)),
            "rope_local_theta": 10000.0, "query_pre_attn_scalar": float(scalar), "hidden_act": "gelu_pytorch_tanh",
            "rms_norm_eps": float(value(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6))}


GEMMA3 = register(Architecture(
    name="gemma3", hf_names=("Gemma3ForCausalLM",), gguf_name="gemma3",
    model_class_path="pagedserve.models.gemma3:Gemma3ForCausalLM", layer_shapes=gemma3_layer_shapes,
    global_shapes=llama_global_shapes,
    gguf_layer_names={**LLAMA_GGUF_LAYER_NAMES, **QK_NORM_GGUF_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    gguf_global_names=LLAMA_GGUF_GLOBAL_NAMES, load_transform=fold_gemma_norms, gguf_config_fields=gemma3_gguf_fields))
