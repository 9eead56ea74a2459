"""How many threads numpy's BLAS (OpenBLAS) uses, read and set at run time.

OpenBLAS reads OPENBLAS_NUM_THREADS / OMP_NUM_THREADS once, when numpy is imported, and otherwise uses
every core. On a host where other processes are busy, its threads wait on each other and small matmuls
get many times slower (docs/benchmarks.md: 2 threads beside one busy process run a decode-heavy load at
32 tok/s, 1 thread at 58). A server that shares its cores sets its own count here, after numpy is loaded,
through the library's set_num_threads entry point, found by name in the process (numpy's wheels bundle
OpenBLAS as libscipy_openblas64_; distribution builds export the plain names). Linux only.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np  # noqa: F401  (loads the BLAS library whose threads this module controls)

# (setter, getter) pairs, as the OpenBLAS builds numpy ships with or links against name them.
_SYMBOLS = (
    ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
    ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
    ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
    ("openblas_set_num_threads", "openblas_get_num_threads"),
)


@lru_cache(maxsize=1)
def _openblas() -> tuple[object, object] | None:
    """(set, get) functions of the OpenBLAS loaded in this process, or None when there is none."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps
                            if "openblas" in line.lower() and line.split()[-1].startswith("/")})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for setter, getter in _SYMBOLS:
            if hasattr(lib, setter) and hasattr(lib, getter):
                set_fn, get_fn = getattr(lib, setter), getattr(lib, getter)
                set_fn.argtypes, set_fn.restype = [ctypes.c_int], None
                get_fn.argtypes, get_fn.restype = [], ctypes.c_int
                return set_fn, get_fn
    return None


def blas_threads() -> int | None:
    """Threads numpy's OpenBLAS uses now; None when numpy's BLAS is not an OpenBLAS found here."""
    fns = _openblas()
    return int(fns[1]()) if fns else None


def set_blas_threads(count: int) -> None:
    """Make numpy's OpenBLAS use `count` threads from now on, for the whole process."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"cpu_threads must be a positive integer, got {count!r}")
    fns = _openblas()
    if fns is None:
        raise ValueError("cpu_threads: cannot set the BLAS thread count: no OpenBLAS is loaded in this process "
                         "(numpy uses another BLAS); set OMP_NUM_THREADS or that library's own variable "
                         "before starting instead")
    fns[0](count)
