"""Running a check as AVX2 code on any host.

numba compiles for the CPU that NUMBA_CPU_NAME and NUMBA_CPU_FEATURES name, so a child process told
"haswell" with these features runs the kernels' AVX2 variants (16 vector registers of 8 floats) even
on an AVX-512 machine, and tests of those variants run in CI whatever CPU it has. The child gets its own
numba cache and finds the suite's helpers (numerics) on its path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

AVX2_FEATURES = "+avx,+avx2,+fma,+sse4.2,+popcnt,+bmi,+bmi2,+f16c,+lzcnt,+movbe,+xsave"


def run_as_avx2(script: str, cache_dir: Path) -> subprocess.CompletedProcess:
    """Run `script` with `python -c` compiled for an AVX2 CPU; returns the finished process."""
    tests = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": AVX2_FEATURES,
           "NUMBA_CACHE_DIR": str(cache_dir), "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
