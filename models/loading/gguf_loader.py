"""Loading GGUF files of the registry's architectures: config from metadata, tensors dequantized to float32.

Every tensor is dequantized to float32 at load: k-quants (Q2_K to Q6_K, super-blocks of 256) by our numpy
reference (cupy_kernels/reference/quant.py's `dequantize_kquant`), the other types by the gguf package.
Matmul weights stored as Q8_0, Q4_0 or Q4_1 blocks are also kept as blocks (cupy_kernels/reference/quant.py), under
the float32 weight's name plus ".q4.qs", ".q4.scales", ".q4.mins" or ".q8.qs", ".q8.scales"
(`quant_names`); the model reads them back with `quant_weight`. The CPU's numba kernels multiply a few
rows by the blocks directly (numba_cpu/quant.py); everything else uses the float32 weights, which are the
blocks' exact values. k-quant weights are not kept as blocks: a Q4_K_M file's decode runs on float32.

llama.cpp's converter reorders the rows of q and k so that rotary pairs are interleaved
(GPT-J style) for the families whose registry entry says so (Llama); our rotary op uses the Hugging Face
"rotate half" layout, so `unpermute_qk` puts the rows back. Tensor names are mapped to Hugging Face names
by the entry's GGUF name map (models/registry.py), so one model class serves both formats; the entry's
`gguf_config_fields` reads the metadata its family adds, and its `load_transform` reshapes the tensors.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from pagedserve.cupy_kernels.reference.quant import (
    KQUANT_TYPES, QUANT_TYPES, QuantWeight, dequantize, dequantize_kquant, kind_of, make_quant_weight, split_blocks,
)

from .. import refusals, registry
from ..config import ModelConfig
from .gguf_metadata import GGUFFile, GGUFTensor, read_gguf

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: str | Path) -> GGUFFile:
    """The metadata and memory-mapped tensors of `path` (gguf_metadata.read_gguf), with a ValueError naming
    the file when it is missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: GGUF file not found")
    return read_gguf(path)


def field_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def gguf_config(reader, path: str | Path) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    entry = registry.lookup_gguf(arch, source=str(path))

    def need(key: str):
        value = field_value(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(field_value(reader, f"{arch}.attention.head_count_kv", heads))
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    vocab = field_value(reader, f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"{path}: GGUF metadata gives no vocab size")
    head_dim = int(field_value(reader, f"{arch}.attention.key_length", hidden // heads))
    try:  # the facts config.json would refuse, where the metadata carries them
        checked = refusals.check_gguf_metadata(arch, entry.name, lambda key, default=None:
                                               field_value(reader, key, default), head_dim)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    tensor_names = {t.name for t in reader.tensors}
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    fields = dict(
        architecture=entry.name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(field_value(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=entry.qkv_bias or "blk.0.attn_q.bias" in tensor_names,
        o_proj_bias=entry.name == "llama" and "blk.0.attn_output.bias" in tensor_names,  # as llama.cpp's llama
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        name=str(field_value(reader, "general.name", "")),
        **checked,
    )
    if entry.gguf_config_fields is not None:  # what the family reads beyond the Llama block's keys
        fields.update(entry.gguf_config_fields(arch, lambda key, default=None: field_value(reader, key, default)))
    return ModelConfig(**fields)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> rotate-half halves).

    Rows of one head go from [x0, y0, x1, y1, ...] back to [x0, x1, ..., y0, y1, ...]. Works for
    weights [rows, cols] and biases [rows].
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(tensor: GGUFTensor, path) -> np.ndarray:
    """A GGUF tensor as float32, shaped as numpy reads it: [rows, cols] for a matrix (GGUF lists dims fastest
    first). ValueError naming the file and tensor for a type we cannot read."""
    from gguf import GGMLQuantizationType, quants

    qtype = tensor.tensor_type
    try:
        if qtype == GGMLQuantizationType.F32:
            w = np.array(np.asarray(tensor.data).view(np.float32))
        elif qtype.name in KQUANT_TYPES:
            w = dequantize_kquant(qtype.name, np.asarray(tensor.data))
        else:
            w = quants.dequantize(tensor.data, qtype).astype(np.float32, copy=False)
    except NotImplementedError:
        raise ValueError(f"{path}: tensor {tensor.name!r} uses quant type {qtype.name}, "
                         "which this gguf package cannot dequantize") from None
    dims = [int(d) for d in reversed(tensor.shape)]
    if w.size != int(np.prod(dims)):
        raise ValueError(f"{path}: tensor {tensor.name!r} dequantized to {w.size} values, "
                         f"expected {int(np.prod(dims))}")
    return w.reshape(dims)


def is_quant_name(name: str) -> bool:
    return any(name.endswith(f".q{b}.{part}") for b in (4, 8) for part in ("qs", "scales", "mins"))


def quant_names(name: str, kind: str) -> dict[str, str]:
    """The block arrays' names for float32 weight `name`: {"qs": ..., "scales": ...[, "mins": ...]}."""
    parts = ("qs", "scales", "mins") if kind == "q4" else ("qs", "scales")
    return {part: f"{name}.{kind}.{part}" for part in parts}


def quant_weight(weights: dict[str, np.ndarray], name: str) -> QuantWeight | None:
    """The blocks of weight `name` when `weights` hold them (a GGUF model), else None."""
    for kind in ("q4", "q8"):
        names = quant_names(name, kind)
        if all(n in weights for n in names.values()):
            mins = weights[names["mins"]] if kind == "q4" else None
            return make_quant_weight(kind, weights[names["qs"]], weights[names["scales"]], mins)
    return None


def _quant_arrays(tensor, hf_name: str, rows_fix) -> dict[str, np.ndarray]:
    """The block arrays of a 2-D matmul weight stored as Q8_0/Q4_0/Q4_1 (empty for other tensors)."""
    qtype = tensor.tensor_type.name
    if qtype not in QUANT_TYPES or len(tensor.shape) != 2:
        return {}
    arrays = split_blocks(qtype, np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1))
    names = quant_names(hf_name, kind_of(qtype))
    return {names[part]: np.ascontiguousarray(rows_fix(a)) for part, a in arrays.items()}


def load_gguf_weights(path: str | Path, reader: GGUFFile | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and float32 weights (Hugging Face names, HF q/k row order) of a GGUF file, plus the
    block arrays of its quantized matmul weights (`quant_names`)."""
    reader = reader or open_gguf(path)
    config = gguf_config(reader, path)
    entry = registry.for_config(config)
    layer_names, global_names = entry.gguf_layer_names, entry.gguf_global_names
    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name in global_names:
            hf_name = global_names[name]
        elif (m := _LAYER_RE.match(name)) and m.group(2) in layer_names:
            hf_name = f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
        else:
            raise ValueError(f"{path}: unexpected tensor {name!r} for a {entry.name} model")

        def rows_fix(a):
            if not entry.gguf_qk_permuted:
                return a
            if ".attn_q." in name:
                return unpermute_qk(a, config.num_attention_heads)
            if ".attn_k." in name:
                return unpermute_qk(a, config.num_key_value_heads)
            return a

        blocks = _quant_arrays(tensor, hf_name, rows_fix)
        if tensor.tensor_type.name in ("Q8_0", "Q4_1") and blocks:
            # From the blocks kept anyway: bit-identical to gguf.quants (the same expression), ~2x faster (#37)
            weights[hf_name] = dequantize(quant_weight(blocks, hf_name))
        else:
            weights[hf_name] = np.ascontiguousarray(rows_fix(dequantize_tensor(tensor, path)))
        weights.update(blocks)
    if entry.load_transform is not None:  # the family's reshaping of its checkpoint (registry.py)
        entry.load_transform(config, weights, "gguf")
    refusals.check_tensors(config, weights, str(path))  # a mapped name the config does not use (an o_proj bias)
    return config, weights
