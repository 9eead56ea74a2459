"""Start-up calibration of the speculation policy's step costs: this host's, not a prior's.

Whether a verify step of 1 + d rows pays depends on what it costs against a 1-row decode step, which on a
CPU depends on the host: its vector width (the numba code path), its BLAS kernel and threads, the model's
weight format. The policy (policy.py) learns those costs from the steps it runs, but until it has, it
decides from a prior shape; a host where rows are dear would lose time on the first verify steps of every
engine, one where they are cheap would wait to speculate.

So when an engine that speculates starts on the CPU backend, a few forwards of the real model are timed at
1..9 rows (one sequence, a short context, the shape of a verify step), with the clock the policy uses
(process CPU time), the cheapest of a few runs per row count, in at most ~2 s, and the policy's costs are
seeded with them. The figures are cached in a small JSON file beside the numba cache
(`<cache root>/spec_step_costs.json`), keyed by the CPU model, the numba code path, the kernel set, the BLAS
kernel and threads, the kernel sources' digest and the model, so a later start on the same host loads them
instead. Skipped on a GPU (the GPU prior holds: extra rows cost little), under tensor parallelism, when
speculation is off, and when `min_acceptance_rate` replaces the cost rule.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from pagedserve.cupy_kernels.host.cache_dir import cache_root

ROWS = tuple(range(1, 10))  # a decode step and verify steps of 1..8 drafts
REPEATS = 2  # timed runs per row count (after one untimed): the cheapest is kept
BUDGET_S = 2.0  # wall-clock bound on the whole calibration; row counts not reached are left to the prior
CONTEXT = 64  # tokens already in the cache of the calibration sequence
FILE_NAME = "spec_step_costs.json"
MAX_ENTRIES = 32  # hosts x models kept in the file (the oldest entries go first)


def cache_file() -> Path:
    return cache_root() / FILE_NAME


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_key(*parts: Any) -> str:
    """The cache key: the CPU and whatever else the caller says the costs depend on."""
    return "|".join(str(p) for p in (cpu_name(), os.cpu_count(), *parts))


def engine_key(worker: Any) -> str:
    """What a model's step costs depend on besides the CPU: the numba code path and the kernel sources (their
    cache folder names the digest), the kernel set, the BLAS kernel and threads, the model and the KV dtype."""
    from pagedserve.cupy_kernels.host.blas_threads import blas_info
    from pagedserve.cupy_kernels.kernel_set import numba_code_path

    blas = blas_info() or {}
    return host_key(numba_code_path(), os.environ.get("NUMBA_CACHE_DIR"), worker.backend.ops.name,
                    blas.get("architecture"), blas.get("num_threads"), worker.model_name, worker.model_path,
                    worker.kv_layout.dtype)


def load(key: str, path: Path | None = None) -> dict[int, float] | None:
    """Cached seconds by row count for `key`, or None (no file, no entry, unreadable)."""
    try:
        entry = json.loads((path or cache_file()).read_text()).get(key)
        costs = {int(m): float(s) for m, s in entry["seconds"].items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return costs if costs and all(s > 0 for s in costs.values()) else None


def store(key: str, seconds: dict[int, float], path: Path | None = None) -> None:
    """Add `key`'s figures to the file (written whole, atomically); a failure to write is not an error."""
    path = path or cache_file()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data.pop(key, None)
    data[key] = {"seconds": {str(m): s for m, s in sorted(seconds.items())}, "measured_at": time.time()}
    while len(data) > MAX_ENTRIES:
        data.pop(next(iter(data)))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def measure(forward: Callable[[int], Any], clock: Callable[[], float], rows: Iterable[int] = ROWS,
            repeats: int = REPEATS, budget_s: float = BUDGET_S) -> dict[int, float]:
    """The cheapest of `repeats` timed calls of forward(m) per row count m, stopping once `budget_s` of wall
    time is spent (the row counts measured so far are returned)."""
    out: dict[int, float] = {}
    deadline = time.perf_counter() + budget_s
    for m in rows:
        forward(m)  # untimed: first-call costs (allocations, a kernel's first run at this shape)
        best = float("inf")
        for _ in range(repeats):
            started = clock()
            forward(m)
            best = min(best, clock() - started)
        out[m] = max(best, 1e-9)
        if time.perf_counter() > deadline:
            break
    return out


def seed_policy(policy: Any, key: str, forward: Callable[[int], Any], clock: Callable[[], float],
                path: Path | None = None) -> str:
    """Seed policy.costs from the cache or a fresh measurement; returns "cached" or "measured"."""
    seconds = load(key, path)
    source = "cached"
    if seconds is None:
        seconds = measure(forward, clock)
        store(key, seconds, path)
        source = "measured"
    policy.costs.seed(seconds)
    return source


def verify_forward(executor: Any, block_size: int, num_blocks: int) -> Callable[[int], Any] | None:
    """forward(m): one sequence's step of m new tokens after CONTEXT cached ones, through the executor, in
    the pool's first blocks (free in a new engine: nothing is hashed or read there before it is written again).
    None when the pool is too small for it."""
    from pagedserve.models.batch import SeqChunk, build_forward_batch

    from ..worker.worker import ExecuteModelRequest

    context = min(CONTEXT, num_blocks * block_size - max(ROWS))
    if context < 0:
        return None
    table = list(range(-(-(context + max(ROWS)) // block_size)))

    def forward(m: int) -> Any:
        chunk = SeqChunk(token_ids=[1] * m, num_computed_tokens=context, block_table=table, num_logits=m)
        return executor.execute_model(ExecuteModelRequest(build_forward_batch([chunk], block_size)))

    return forward
