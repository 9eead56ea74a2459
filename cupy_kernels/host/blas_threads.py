"""How many threads the CPU backend uses (numpy's BLAS and numba's parallel loops), and which BLAS kernel
runs the matmuls.

OpenBLAS reads OPENBLAS_NUM_THREADS / OMP_NUM_THREADS once, when numpy is imported, and otherwise uses
every core. On a host where other processes are busy, its threads wait on each other and small matmuls
get many times slower (docs/benchmarks.md: 2 threads beside one busy process run a decode-heavy load at
32 tok/s, 1 thread at 58). A server that shares its cores sets its own count here (`cpu_threads`), after
numpy is loaded. threadpoolctl finds the BLAS library numpy loaded and calls its own set_num_threads.

The kernel OpenBLAS picked for this CPU (`architecture`: SkylakeX, Zen, Haswell, ...) decides the matmul
rate: a host that sets OPENBLAS_CORETYPE=Haswell runs AVX2 kernels on an AVX-512 CPU at about half the
speed. `blas_info()` reports it for the logs, `pagedserve stats` and the benchmarks' environment header.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np  # noqa: F401  (loads the BLAS library whose threads this module controls)
from threadpoolctl import ThreadpoolController


@lru_cache(maxsize=1)
def _controller() -> ThreadpoolController | None:
    """threadpoolctl's handle on the BLAS libraries in this process (OpenBLAS first), or None."""
    blas = ThreadpoolController().select(user_api="blas")
    return blas if blas.lib_controllers else None


def blas_info() -> dict | None:
    """numpy's BLAS: {"internal_api", "version", "architecture", "num_threads"}; None when none is found."""
    c = _controller()
    if c is None:
        return None
    lib = c.lib_controllers[0].info()
    return {"internal_api": lib.get("internal_api"), "version": lib.get("version"),
            "architecture": lib.get("architecture"), "num_threads": lib.get("num_threads")}


def blas_threads() -> int | None:
    """Threads numpy's BLAS uses now; None when no BLAS library is found in this process."""
    c = _controller()
    return int(c.lib_controllers[0].num_threads) if c is not None else None


def set_blas_threads(count: int) -> None:
    """Make numpy's BLAS use `count` threads from now on, for the whole process."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"cpu_threads must be a positive integer, got {count!r}")
    c = _controller()
    if c is None:
        raise ValueError("cpu_threads: cannot set the BLAS thread count: threadpoolctl finds no BLAS library "
                         "in this process; set OMP_NUM_THREADS or that library's own variable before starting "
                         "instead")
    for lib in c.lib_controllers:
        lib.set_num_threads(count)


_cpu_threads: int | None = None  # the last cpu_threads setting; numba_setup.apply_threads follows it


def set_cpu_threads(count: int) -> None:
    """`cpu_threads`: numpy's BLAS threads now, and numba's parallel-loop threads from the next kernel call
    (numba's count is per calling thread, and the engine steps in a worker thread of its own)."""
    global _cpu_threads
    set_blas_threads(count)
    _cpu_threads = count


def cpu_threads() -> int | None:
    return _cpu_threads


def reset_cpu_threads(blas_count: int) -> None:
    """Back to the state before any cpu_threads setting: BLAS at `blas_count` threads, numba's loops on its
    whole pool (benchmarks that run several settings in one process)."""
    global _cpu_threads
    set_blas_threads(blas_count)
    _cpu_threads = None


# The BLAS thread count this process started with (OPENBLAS_NUM_THREADS, else every core), read when this
# module is first imported, before any setting: cpu_threads="auto" tunes below it.
STARTED_BLAS_THREADS: int | None = blas_threads()

