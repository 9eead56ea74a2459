"""pagedserve.cupy_kernels.

OpenBLAS reads its settings from the environment once, when numpy first loads it, so the one pagedserve
changes is set here, before any pagedserve module imports numpy (models/, runtime/ and sidecar/ import
this package first):

OPENBLAS_THREAD_TIMEOUT=4. After each call OpenBLAS's worker threads spin for 2^timeout cycles (default
2^28, ~0.1 s) waiting for the next one. Between two matmuls the CPU backend runs numba kernels on the same
cores (attention, softmax, norms), and a spinning worker held the second core they wanted: with workers
that sleep at once, a 64-request run went from 447 to 471 tok/s, a long prefill chunk's attention over
30 layers from 262 to 223 ms with its softmax on both threads (on one thread either way: no gain), and
beside a busy process those chunks from 888 to 564 ms (docs/benchmarks.md). Waking them costs
microseconds per call: one request's decode stayed at 16.5 ms per token.

A value the user set wins. When numpy was imported before pagedserve, OpenBLAS already has its value and
this process keeps it (OPENBLAS_ENV_APPLIED is False).
"""

import os
import sys

OPENBLAS_DEFAULTS = {"OPENBLAS_THREAD_TIMEOUT": "4"}
OPENBLAS_ENV_APPLIED = "numpy" not in sys.modules
if OPENBLAS_ENV_APPLIED:
    for _name, _value in OPENBLAS_DEFAULTS.items():
        os.environ.setdefault(_name, _value)
