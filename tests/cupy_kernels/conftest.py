"""GPU tests (marked `gpu`) skip, with the reason, where CuPy or a CUDA device is missing."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def gpu_skip_reason() -> str | None:
    try:
        import cupy
    except Exception as e:  # ImportError, or a CuPy built for another CUDA failing to load
        return f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver
        return f"CuPy sees no CUDA device ({type(e).__name__}: {e})"
    if count == 0:
        return "CuPy sees no CUDA device"
    return None


@pytest.fixture(autouse=True)
def _skip_gpu_tests_without_a_device(request):
    if request.node.get_closest_marker("gpu") is not None:
        reason = gpu_skip_reason()
        if reason is not None:
            pytest.skip(f"needs a GPU: {reason}")
