"""glibc malloc settings for the CPU backend, whose forward pass allocates its activations anew each op.

A decode step of 64 sequences allocates hundreds of arrays of 100 KB - 13 MB (matmul outputs, SiLU's
[T, intermediate], logits). glibc serves an allocation over its mmap threshold (128 KB at start, raised
by itself up to 32 MB as such blocks are freed) with a fresh mmap, and gives the top of a heap back to
the kernel once more than its trim threshold (twice the mmap threshold) lies free there. Either way
the next step's arrays land in pages the kernel must fault in and zero again: 0.34 s per GiB on the
test VM. In bench/throughput.py's 64-request run that was ~1 s of 18.5 (silu_and_mul alone 1.0 s
against 0.37 s once the pages are kept; 439 -> 455-463 tok/s).

tune_malloc() keeps them: allocations up to 256 MB come from the heap, and up to 1 GiB free at a heap's
top stays mapped. What this holds beyond the live arrays is at most one step's peak of temporaries,
which the memory budget already counts (runtime/worker/memory_budget.py, activations). Called once per CPU
worker; a user who set glibc's own MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ (read at process
start) keeps them, and on a C library other than glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform

import numpy as np

MMAP_THRESHOLD = 256 << 20  # bytes: allocations up to this size come from the heap
TRIM_THRESHOLD = 1 << 30  # bytes free at a heap's top before glibc returns them to the kernel
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
_USER_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_result: dict | None = None


def tune_malloc() -> dict:
    """Apply the settings once per process; returns what happened, for the engine's log line."""
    global _result
    if _result is not None:
        return _result
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        _result = {"malloc_tuned": False, "malloc_reason": "not glibc"}
    elif any(name in os.environ for name in _USER_ENV):
        _result = {"malloc_tuned": False, "malloc_reason": "set by the environment"}
    else:
        libc = ctypes.CDLL(None)
        ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
        _result = {"malloc_tuned": ok, "malloc_reason": "mallopt" if ok else "mallopt refused"}
    return dict(_result)


CACHE_LINE = 64  # bytes


def aligned_empty(shape, dtype=np.float32, align: int = CACHE_LINE) -> np.ndarray:
    """np.empty(shape, dtype) starting on an `align`-byte boundary (a cache line by default). malloc gives 16:
    a packed GEMM's 64-byte panel loads and tile stores then straddle two cache lines each (numba_gemm.py).
    ~1.8 us a call against np.empty's 0.2 (reading the address costs most)."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = np.empty(nbytes + align, dtype=np.uint8)
    start = -buf.ctypes.data % align
    return buf[start:start + nbytes].view(dtype).reshape(shape)


def aligned_zeros(shape, dtype=np.float32, align: int = CACHE_LINE) -> np.ndarray:
    """aligned_empty, zeroed."""
    out = aligned_empty(shape, dtype, align)
    out.fill(0)
    return out
