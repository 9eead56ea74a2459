"""The conversion cache's entry is written in the background on a first start (weight_cache.save_entry_later):
the same process's next load waits for it, and a writer that died mid-write leaves nothing for long."""

from __future__ import annotations

import subprocess
import sys

from model_factory import random_model, write_gguf

from pagedserve.models.loading import loader, weight_cache
from pagedserve.models.loading.loader import load_model
from pagedserve.models.tokenizer.tokenizer import load_hf_tokenizer


def test_a_first_load_writes_its_entry_aside_and_the_next_load_reads_it(tmp_path, monkeypatch, data_dir):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    # write_gguf writes no vocabulary: the tiny HF model's tokenizer stands in for the file's
    monkeypatch.setattr(loader, "load_gguf_tokenizer", lambda path, reader: load_hf_tokenizer(data_dir / "tiny-llama"))
    cfg, w = random_model("llama", seed=3, hidden=64, head_dim=16, heads=4, kv_heads=2)
    write_gguf(tmp_path / "m.gguf", cfg, w, "Q8_0")
    first = load_model(tmp_path / "m.gguf")
    second = load_model(tmp_path / "m.gguf")  # waits for the first load's write, then reads the entry
    assert not first.from_cache and second.from_cache
    assert set(second.weights) == set(first.weights)
    for name, a in first.weights.items():
        assert (second.weights[name] == a).all(), name
    assert not weight_cache._pending
    assert not list((tmp_path / "cache").glob(".tmp-*"))


def test_a_dead_writers_temporary_directory_is_removed_by_the_next_write(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited (a pid reused meanwhile only keeps the folder longer)
    orphan = tmp_path / f".tmp-{pid}-abc"
    orphan.mkdir(parents=True)
    (orphan / "model.safetensors").write_bytes(b"half")
    unrelated = tmp_path / ".tmp-notapid-x"
    unrelated.mkdir()
    cfg, w = random_model("llama", seed=3, hidden=64, head_dim=16, heads=4, kv_heads=2)
    weight_cache.save_entry_later(tmp_path, "d", cfg, w, {}).join()
    assert not orphan.exists() and unrelated.exists()
    assert weight_cache.load_entry(tmp_path, "d") is not None
