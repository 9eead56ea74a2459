"""Reading and setting numpy's OpenBLAS thread count at run time, and the engine's cpu_threads knob."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.cupy_kernels.host import blas_threads as bt
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


def test_without_a_blas_the_error_says_what_to_do(monkeypatch):
    monkeypatch.setattr(bt, "_controller", lambda: None)
    assert bt.blas_threads() is None and bt.blas_info() is None
    with pytest.raises(ValueError, match="finds no BLAS library in this process"):
        bt.set_blas_threads(1)


def test_blas_info_names_the_kernel(restore_threads):
    info = bt.blas_info()
    assert info["num_threads"] == restore_threads
    assert info["internal_api"] == "openblas" and info["architecture"]  # e.g. "SkylakeX", "Zen", "Haswell"


def test_numba_threads_follow_cpu_threads(restore_threads, monkeypatch):
    """numba's count is per calling thread: apply_threads sets it in whichever thread runs the kernels."""
    import threading

    from pagedserve.cupy_kernels.numba_cpu import setup as numba_setup

    monkeypatch.setattr(bt, "_cpu_threads", None)
    bt.set_cpu_threads(1)
    seen = []

    def worker():
        numba_setup.apply_threads()
        seen.append(numba_setup.numba.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [1] and bt.blas_threads() == 1


def test_engine_applies_cpu_threads(restore_threads):
    from server_proc import TINY

    from pagedserve.runtime import LLM

    bt.set_blas_threads(2)
    LLM(TINY, device="cpu", cpu_threads=1, kv_cache_memory_bytes=8 << 20)
    assert bt.blas_threads() == 1
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer"):
        EngineConfig(cpu_threads=0)


def _fresh_python(code: str, **env_changes: str | None) -> str:
    """Run `code` in a new interpreter (numpy not yet loaded) and return what it prints."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    for name, value in env_changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


SHOW = ("import os, pagedserve.cupy_kernels as k; "
        "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'), k.OPENBLAS_ENV_APPLIED)")


def test_importing_pagedserve_first_sets_openblas_thread_timeout():
    assert _fresh_python("import pagedserve.runtime; " + SHOW, OPENBLAS_THREAD_TIMEOUT=None) == "18 True"
    # every subpackage sets it, whichever is imported first (its modules import numpy)
    assert _fresh_python("import pagedserve.models.loading.loader; " + SHOW, OPENBLAS_THREAD_TIMEOUT=None) == "18 True"


def test_a_users_openblas_setting_wins():
    assert _fresh_python("import pagedserve.runtime; " + SHOW, OPENBLAS_THREAD_TIMEOUT="12") == "12 True"


def test_after_numpy_the_environment_is_left_alone():
    """OpenBLAS has already read its environment: setting it now would only mislead child processes."""
    assert _fresh_python("import numpy; import pagedserve.runtime; " + SHOW, OPENBLAS_THREAD_TIMEOUT=None) == \
        "None False"
