"""Reading and setting numpy's OpenBLAS thread count at run time, and the engine's cpu_threads knob."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.cupy_kernels import blas_threads as bt
from pagedserve.runtime.config import EngineConfig

pytestmark = pytest.mark.skipif(bt.blas_threads() is None, reason="numpy's BLAS is not an OpenBLAS found here")


@pytest.fixture
def restore_threads():
    before = bt.blas_threads()
    yield before
    bt.set_blas_threads(before)
    assert bt.blas_threads() == before


def test_set_and_read_back(restore_threads):
    bt.set_blas_threads(1)
    assert bt.blas_threads() == 1
    a = np.ones((256, 256), np.float32)
    assert float((a @ a)[0, 0]) == 256.0  # BLAS still works with the new count
    bt.set_blas_threads(2)
    assert bt.blas_threads() == 2


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_bad_counts_name_the_setting(bad, restore_threads):
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer"):
        bt.set_blas_threads(bad)
    assert bt.blas_threads() == restore_threads  # nothing changed


def test_without_openblas_the_error_says_what_to_do(monkeypatch):
    monkeypatch.setattr(bt, "_openblas", lambda: None)
    assert bt.blas_threads() is None
    with pytest.raises(ValueError, match="no OpenBLAS is loaded in this process"):
        bt.set_blas_threads(1)


def test_engine_applies_cpu_threads(restore_threads):
    from server_proc import TINY

    from pagedserve.runtime import LLM

    bt.set_blas_threads(2)
    LLM(TINY, device="cpu", cpu_threads=1, kv_cache_memory_bytes=8 << 20)
    assert bt.blas_threads() == 1
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer"):
        EngineConfig(cpu_threads=0)
