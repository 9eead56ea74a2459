"""A conversion cache for GGUF weights: dequantizing takes seconds, reading float32 safetensors does not.

Entries live in `<cache root>/gguf-<sha256 of the GGUF file>-v<format>/` and hold model.safetensors
(float32, Hugging Face names, q/k already un-permuted, plus the block arrays of quantized matmul weights),
config.json and the tokenizer files. Keying by content hash means a replaced or edited file never reuses a
stale entry. Entries are written to a temporary directory and renamed into place, so a crash mid-write leaves
no half entry behind (and the next write removes the temporary directory a dead process left). A start with an
empty cache writes its entry in a background thread at the lowest CPU priority (save_entry_later): ~1 s of a
cold start's CPU time (650 MB for the embedded SmolLM2) that serving does not wait for. (A packaged model's
joined GGUF file lives beside the entries, in `<cache root>/packaged/`: packaged.py.) The packaged Gemma 3
270M's entry is about 1.2 GB: its 262,144 x 640 embedding alone is 640 MB of float32, plus its Q8_0 blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np

from pagedserve.cupy_kernels.host.cache_dir import cache_root  # noqa: F401  (re-exported: loader.py asks here)

from ..config import ModelConfig
from .safetensors_io import read_safetensors
from ..tensor_parallel import TPShard, check_tensor_parallel

# 2: the GGUF blocks of quantized matmul weights are kept too (gguf_loader.quant_names); 3: written only after
# the loader's refusals (models/refusals.py) passed, so an entry of a file they now refuse is not read
CACHE_FORMAT = 3


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def entry_dir(root: Path, digest: str) -> Path:
    return root / f"gguf-{digest}-v{CACHE_FORMAT}"


def save_entry(root: Path, digest: str, config: ModelConfig, weights: dict[str, np.ndarray],
               extra_files: dict[str, str]) -> Path:
    """Write an entry atomically; returns its directory. `extra_files` maps file names to text."""
    from safetensors.numpy import save_file

    final = entry_dir(root, digest)
    root.mkdir(parents=True, exist_ok=True)
    _remove_orphans(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-", dir=root))
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
        for name, text in extra_files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race and wrote the same entry
            shutil.rmtree(tmp, ignore_errors=True)
        for stale in root.glob(f"gguf-{digest}-v*"):  # the same file in an older format: never read again
            if stale != final:
                shutil.rmtree(stale, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _remove_orphans(root: Path) -> None:
    """Remove the temporary directories of writers that died mid-write (named .tmp-<pid>-...)."""
    for tmp in root.glob(".tmp-*-*"):
        try:
            pid = int(tmp.name.split("-")[1])
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # alive (another user's): leave it


_pending: dict[Path, threading.Thread] = {}  # entries save_entry_later is writing in this process
_pending_lock = threading.Lock()


def save_entry_later(root: Path, digest: str, config: ModelConfig, weights: dict[str, np.ndarray],
                     extra_files: dict[str, str]) -> threading.Thread:
    """save_entry in a background thread at nice 19 (Linux sets it per thread), so that a first start does not
    wait for the write; load_entry of the same entry in this process waits for it, and the interpreter for it
    at exit (a non-daemon thread). `weights` must not be written to meanwhile. An OSError (an unwritable
    cache) only costs time on the next start, as before."""
    final = entry_dir(root, digest)

    def write() -> None:
        try:
            if hasattr(os, "setpriority"):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        try:
            save_entry(root, digest, config, weights, extra_files)
        except OSError:
            pass
        finally:
            with _pending_lock:
                if _pending.get(final) is threading.current_thread():
                    del _pending[final]

    thread = threading.Thread(target=write, name="pagedserve-weight-cache-write", daemon=False)
    with _pending_lock:
        _pending[final] = thread
    thread.start()
    return thread


def wait_for_writes() -> None:
    """Wait until every entry save_entry_later started in this process is written."""
    with _pending_lock:
        threads = list(_pending.values())
    for thread in threads:
        thread.join()


def load_entry(root: Path, digest: str, shard: TPShard | None = None
               ) -> tuple[ModelConfig, dict[str, np.ndarray], Path] | None:
    """The cached config and weights (only `shard`'s slices, read from the memory-mapped file), or None
    when there is no complete entry. An entry this process is still writing is waited for."""
    d = entry_dir(root, digest)
    with _pending_lock:
        writing = _pending.get(d)
    if writing is not None:
        writing.join()
    if not (d / "model.safetensors").is_file() or not (d / "config.json").is_file():
        return None
    try:
        cfg = json.loads((d / "config.json").read_text())
        cfg["eos_token_ids"] = tuple(cfg.get("eos_token_ids") or ())
        config = ModelConfig(**cfg)
    except (ValueError, TypeError, OSError):
        return None  # a damaged entry is rebuilt, never trusted
    select = None
    if shard is not None and shard.is_sharded:
        check_tensor_parallel(config, shard.world_size)  # a ValueError naming the numbers, not a cache miss
        select = functools.partial(shard.index_for, config)
    try:
        weights = read_safetensors(d / "model.safetensors", select=select)
    except (ValueError, TypeError, OSError):
        return None  # a damaged entry is rebuilt, never trusted
    return config, weights, d
