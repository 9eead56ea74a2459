"""Fixtures shared by the runtime tests."""

from __future__ import annotations

import pytest

from pagedserve.models.loading.loader import load_model


@pytest.fixture(scope="module")
def tiny(data_dir):
    """The tiny committed Llama (tests/data/tiny-llama), loaded once per test module."""
    return load_model(data_dir / "tiny-llama")
