"""Finding the tokenizer a committed golden file was made with (shared by the tokenizer and chat tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.models.tokenizer.tokenizer import Tokenizer, load_hf_tokenizer

DATA = Path(__file__).parent / "data"


def golden_tokenizer(model: str, golden: Path, request: pytest.FixtureRequest, smol_gguf: Path) -> Tokenizer:
    """tests/data/<model>/ when that is a model directory, else the GGUF the goldens manifest names for it
    (only the embedded SmolLM2 file is known: its tokenizer comes from the calling module's `smol` fixture)."""
    model_dir = DATA / model
    if (model_dir / "tokenizer.json").is_file():
        return load_hf_tokenizer(model_dir)
    manifest = DATA / "goldens" / "manifest.json"
    models = json.loads(manifest.read_text(encoding="utf-8")).get("models", {}) if manifest.is_file() else {}
    if models.get(model, {}).get("gguf_file") == smol_gguf.name:
        return request.getfixturevalue("smol")
    pytest.skip(f"{golden.name}: no model directory {model_dir} and no known GGUF for {model!r} in {manifest}")
