"""Array backends: numpy on the CPU (the reference, runs everywhere) and CuPy on a GPU.

Everything above this package asks for a `Backend` and uses `backend.xp` as its array module and
`backend.ops` as its kernels (kernel_set.py: numpy reference, numba, or CUDA, chosen here once), so the
same model code runs on either. CuPy is imported lazily: a CPU-only install never touches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from .kernel_set import KernelSet, cpu_kernels, cuda_kernels

VALID_DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Backend:
    """An array module plus the storage dtype used for weights and the KV cache."""

    name: str  # "numpy" or "cupy"
    xp: ModuleType
    dtype: np.dtype
    ops: KernelSet | None = None  # None: the default set for `name` (CUDA on cupy, numba-or-numpy on numpy)

    def __post_init__(self) -> None:
        if self.ops is None:
            object.__setattr__(self, "ops", cuda_kernels() if self.name == "cupy" else cpu_kernels("auto"))

    @property
    def is_gpu(self) -> bool:
        return self.name == "cupy"

    def asarray(self, a, dtype=None):
        return self.xp.asarray(a, dtype=dtype)



def finish_warm_up(backend: Backend, kv_cache_dtype: str | None = None) -> None:
    """Make every kernel of `backend` ready (kernel_set.finish_numba_warm_up for the numba set; nothing to do
    for the others), and with a 16- or 8-bit `kv_cache_dtype` the numba loop nest that reads it (numba_cpu/
    attention16.py, attention8.py: compiled only for such a pool). Idempotent."""
    if backend.ops is not None and backend.ops.name == "numba":
        from .kernel_set import finish_numba_warm_up

        finish_numba_warm_up()
        if kv_cache_dtype in ("bfloat16", "float16"):
            from .numba_cpu import attention16

            attention16.warm_up(kv_cache_dtype)
        elif kv_cache_dtype in ("int8", "fp8_e4m3", "fp8_e5m2"):
            from .numba_cpu import attention8

            attention8.warm_up(kv_cache_dtype)


def to_host(a: Any) -> np.ndarray:
    """A numpy array with the contents of `a`: CuPy arrays are copied from the device (they have .get()),
    anything else goes through np.asarray (no copy for a numpy array). The one device->host copy helper."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError when no driver, ...
        return False


def get_backend(device: str = "auto", cpu_kernels_choice: str = "auto", finish_warm_up: bool = True) -> Backend:
    """Return the backend for `device` ("auto", "cpu" or "cuda").

    "auto" picks cuda when CuPy sees a GPU and numpy otherwise. CPU numerics are float32; the CPU
    kernels are numba's when it imports (`cpu_kernels_choice` "auto" or "numba") or the numpy reference.
    `finish_warm_up=False`: the numba set's attention kernels may still be compiling; call
    finish_warm_up(backend) before the first forward.
    """
    if device not in VALID_DEVICES:
        raise ValueError(f"device must be one of {VALID_DEVICES}, got {device!r}")
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cpu":
        return Backend("numpy", np, np.dtype(np.float32), cpu_kernels(cpu_kernels_choice, finish_warm_up))
    if not cuda_available():
        raise ValueError("device='cuda' was asked for, but CuPy is not installed or sees no CUDA device")
    import cupy

    return Backend("cupy", cupy, np.dtype(np.float16), cuda_kernels())


def start_warm_up(device: str = "auto", cpu_kernels_choice: str = "auto") -> None:
    """Start what get_backend(device, choice, finish_warm_up=False) starts (the numba set's compiles: a thread
    and, with an empty cache, a child process), without waiting, so a server can begin them before its own
    imports and socket; the engine's get_backend later finds them under way. Nothing for a GPU."""
    if device in VALID_DEVICES and (device == "cpu" or (device == "auto" and not cuda_available())):
        cpu_kernels(cpu_kernels_choice, False)

