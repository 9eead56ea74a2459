"""The model registry: one entry per architecture, and everything that follows from its shape table.

An `Architecture` says how a family is named (Hugging Face `architectures`, GGUF `general.architecture`),
how GGUF tensor names map to Hugging Face ones and whether llama.cpp permuted the q/k rows, which config
flags it forces (Qwen2's q/k/v bias), which class runs it (imported only when asked for, so that
models/config.py stays light), and one shape table: the tensors of one layer and the global ones, as
functions of the config. Expected shapes (the loaders' checks), weight bytes (the memory budget and the
GPU KV sizing) and matmul FLOPs per token (the scheduler and the benches) are all derived from it here.

A new family is one `register(Architecture(...))` below plus the layers its model class needs.
"""

from __future__ import annotations

import importlib
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
