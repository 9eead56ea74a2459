"""cupy_kernels/host/malloc.py: glibc keeps the CPU backend's freed activation pages (tested in a fresh
interpreter each time: the settings are per process)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the tuning applies to glibc only")

CHURN = """
import json, resource, threading
import numpy as np
from pagedserve.cupy_kernels.host.malloc import tune_malloc
result = tune_malloc() if TUNE else {}
if TUNE:
    assert tune_malloc() == result  # applied once per process; the same answer after
faults = []
def steps():
    for _ in range(3):  # warm: the heap grows to the step's peak
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
def step():  # a step's pattern: outputs that die young, of several sizes, and logits of 256 rows (50 MB:
    keep = []  # above the 32 MB up to which glibc raises its mmap threshold by itself)
    for mb in (0.4, 3.0, 0.8, 50.0, 0.4, 1.5):
        a = np.empty(int(mb * (1 << 20)) // 4, np.float32)
        a.fill(1.0)
        keep.append(a)
        if len(keep) > 2:
            keep.pop(0)
t = threading.Thread(target=steps)  # the engine steps in a thread of its own, as here
t.start(); t.join()
print(json.dumps({"result": result, "faults": faults[0]}))
"""


def run(tune: bool, **env_changes: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    env["NUMPY_MADVISE_HUGEPAGE"] = "0"  # 4 KB pages, so the fault count is a page count
    env.update(env_changes)
    out = subprocess.run([sys.executable, "-c", f"TUNE = {tune}\n" + CHURN], env=env, capture_output=True,
                         text=True, check=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_tuned_heap_keeps_pages_across_steps():
    tuned, plain = run(True), run(False)
    assert tuned["result"] == {"malloc_tuned": True, "malloc_reason": "mallopt"}
    # 20 steps touch ~1.1 GB of arrays: with the pages kept almost none of it faults again; without, the
    # 50 MB one is a fresh mapping each time (12,800 pages)
    assert tuned["faults"] < 2_000, tuned
    assert plain["faults"] > 20 * 10_000, plain


def test_a_users_glibc_settings_win():
    got = run(True, MALLOC_TRIM_THRESHOLD_="131072")
    assert got["result"] == {"malloc_tuned": False, "malloc_reason": "set by the environment"}
