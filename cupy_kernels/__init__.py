"""pagedserve.cupy_kernels.

OpenBLAS reads its settings from the environment once, when numpy first loads it, so the one pagedserve
changes is set here, before any pagedserve module imports numpy (models/, runtime/ and sidecar/ import
this package first):

OPENBLAS_THREAD_TIMEOUT=18. After each call OpenBLAS's worker threads spin for 2^timeout cycles (default
2^28, ~0.1 s) waiting for the next one, then sleep. Between two matmuls the CPU backend runs numba
kernels on the same cores (attention, softmax, norms), and a spinning worker held the second core they
wanted: a 64-sequence decode step's attention over 30 layers took 35.5 ms after matmuls against 23 ms
with workers that sleep, and the long-prefill softmax on two threads ran no faster than on one. 2^18
cycles (~75 us) still covers the short gaps between a step's matmuls, so a worker is awake for the next
one; 4 (sleep at once) gave the same kernel figures, and beside a busy process prefill chunks of 1.0 s
against 0.8 s with 18 (docs/benchmarks.md).

A value the user set wins. When numpy was imported before pagedserve, OpenBLAS already has its value and
this process keeps it (OPENBLAS_ENV_APPLIED is False).
"""

import os
import sys

OPENBLAS_DEFAULTS = {"OPENBLAS_THREAD_TIMEOUT": "18"}
OPENBLAS_ENV_APPLIED = "numpy" not in sys.modules
if OPENBLAS_ENV_APPLIED:
    for _name, _value in OPENBLAS_DEFAULTS.items():
        os.environ.setdefault(_name, _value)
