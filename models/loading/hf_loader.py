"""Loading a Hugging Face model directory: config.json plus one or many *.safetensors files.

A family whose registry entry has a `load_transform` gets its checkpoint reshaped here (Phi-3's fused qkv_proj
and gate_up_proj split into the Llama block's names, Gemma's (1 + w) norms folded). A tensor-parallel rank reads
only its slices, except of the fused tensors (its slices of q, k and v are not one slice of qkv_proj): those are
read whole, split, and then sliced.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from .. import refusals, registry
from ..config import ModelConfig, load_hf_config
from .safetensors_io import read_safetensors
from ..tensor_parallel import TPShard, check_tensor_parallel

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: those named by the shard index if there is one, else every *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: corrupt shard index ({e!r})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index}: names shard files that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weight files found")
    return files


def load_hf_weights(model_dir: str | Path, shard: TPShard | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and float32 weights; with a tensor-parallel `shard`, only that rank's slices are read."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"{model_dir}: model directory not found")
    config = load_hf_config(model_dir)
    entry = registry.for_config(config)
    select = None
    sharded = shard is not None and shard.is_sharded
    if sharded:
        check_tensor_parallel(config, shard.world_size)
        select = functools.partial(shard.index_for, config)  # None (whole) for the fused names it does not know
    weights: dict[str, np.ndarray] = {}
    for f in safetensors_files(model_dir):
        for name, tensor in read_safetensors(f, select=select).items():
            if name in weights:
                raise ValueError(f"{f}: tensor {name!r} appears in more than one shard")
            weights[name] = tensor
    if entry.load_transform is not None:
        fused = {n for n in weights if n.endswith(entry.fused_names)} if entry.fused_names else set()
        before = set(weights)
        try:
            entry.load_transform(config, weights, "hf")
        except ValueError as e:
            raise ValueError(f"{model_dir}: {e}") from None
        if sharded and fused:  # the tensors split from whole fused ones: now this rank's slices
            for name in [n for n in weights if n not in before]:
                index = shard.index_for(config, name)
                if index is not None:
                    weights[name] = np.ascontiguousarray(weights[name][index])
    refusals.check_tensors(config, weights, str(model_dir), shard)  # nothing left unused, as in a GGUF file
    return config, weights
