"""Helpers shared by the benchmarks: the machine's sgemm rate and BLAS thread count, measured in-run."""

from __future__ import annotations

import json
import os
import platform
import sys
import time

import pagedserve.cupy_kernels  # noqa: F401  (sets OpenBLAS's environment before numpy loads it)
import numpy as np


def blas_threads() -> int | None:
    """Threads numpy's OpenBLAS uses (read from the library), else what the environment asks for."""
    from pagedserve.cupy_kernels.host.blas_threads import blas_threads as openblas_threads

    n = openblas_threads()
    if n is not None:
        return n
    v = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    return int(v) if v else os.cpu_count()


def sgemm_gflops(n: int = 1024, seconds: float = 1.0) -> float:
    """float32 matmul rate on this machine, now (so a busy machine shows up in the figure)."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9



def read_gbps(mib: int = 512, repeats: int = 3) -> float:
    """GB/s at which numpy's BLAS streams the matrix of a matrix-vector product far larger than the caches
    (its threads as set), the best of `repeats`. One request's decode streams every weight once per token:
    at this rate that alone takes bench/throughput.py's weights_read_ms_per_token, a floor for its ms per
    token. On the test VM the single-thread read rate moved by a quarter within an hour (its neighbours'
    memory traffic), so figures from different hours differ by that much."""
    a = np.ones(((mib << 18) // 4096, 4096), dtype=np.float32)
    x = np.ones(4096, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        a @ x
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9

def blas_kernel() -> str | None:
    """The kernel numpy's BLAS runs (threadpoolctl's `architecture`: SkylakeX, Zen, Haswell, ...)."""
    from pagedserve.cupy_kernels.host.blas_threads import blas_info

    info = blas_info()
    return info["architecture"] if info else None


def numba_code_path() -> str | None:
    """The code numba compiles the CPU kernels to: avx512, avx2 or baseline (kernel_set.numba_code_path)."""
    from pagedserve.cupy_kernels.kernel_set import numba_code_path as code_path

    return code_path()


def loadavg() -> list[float] | None:
    """1, 5 and 15 minute load averages (Linux): how busy the machine was while a figure was measured."""
    try:
        return [float(x) for x in os.getloadavg()]
    except OSError:
        return None


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "numpy": np.__version__, "blas_threads": blas_threads(), "blas_kernel": blas_kernel(),
            "numba_code_path": numba_code_path(),
            "openblas_coretype_env": os.environ.get("OPENBLAS_CORETYPE"),
            "openblas_thread_timeout_env": os.environ.get("OPENBLAS_THREAD_TIMEOUT")}


def model_flops_per_token(cfg, context_len: float, with_logits: bool) -> float:
    """Matmul FLOPs of one token through the model (2 per multiply-add), attention over `context_len`."""
    return (cfg.matmul_flops_per_token + context_len * cfg.attention_flops_per_key
            + (2 * cfg.hidden_size * cfg.vocab_size if with_logits else 0))


def emit_json(run) -> None:
    """Call run() with file descriptor 1 pointed at stderr, then print its result, alone, on stdout.

    stdout carries the JSON object and nothing else (scripts/gpu_check.sh parses it): whatever run()
    prints on the way - structlog's warnings (they go to stdout unless configured), a library's print,
    a C library writing to fd 1 - lands on stderr instead. On an exception stdout stays empty.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        result = run()
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    print(json.dumps(result, indent=2), flush=True)


def gpu_seconds(cp, fn, iters: int, warmup: int = 2):
    """Seconds per call of `fn()` on the current CUDA stream (CUDA events around `iters` calls, after `warmup`
    calls), and the last call's result."""
    for _ in range(warmup):
        out = fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(iters):
        out = fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3 / iters, out
