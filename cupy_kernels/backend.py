"""Array backends: numpy on the CPU (the reference, runs everywhere) and CuPy on a GPU.

Everything above this package asks for a `Backend` and uses `backend.xp` as its array module, so the
same model code runs on either. CuPy is imported lazily: a CPU-only install never touches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

VALID_DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Backend:
    """An array module plus the storage dtype used for weights and the KV cache."""

    name: str  # "numpy" or "cupy"
    xp: ModuleType
    dtype: np.dtype

    @property
    def is_gpu(self) -> bool:
        return self.name == "cupy"

    def asarray(self, a, dtype=None):
        return self.xp.asarray(a, dtype=dtype)

    def to_numpy(self, a) -> np.ndarray:
        if self.is_gpu:
            return a.get()
        return np.asarray(a)


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError when no driver, ...
        return False


def get_backend(device: str = "auto") -> Backend:
    """Return the backend for `device` ("auto", "cpu" or "cuda").

    "auto" picks cuda when CuPy sees a GPU and numpy otherwise. CPU numerics are float32.
    """
    if device not in VALID_DEVICES:
        raise ValueError(f"device must be one of {VALID_DEVICES}, got {device!r}")
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cpu":
        return Backend("numpy", np, np.dtype(np.float32))
    if not cuda_available():
        raise ValueError("device='cuda' was asked for, but CuPy is not installed or sees no CUDA device")
    import cupy

    return Backend("cupy", cupy, np.dtype(np.float16))
