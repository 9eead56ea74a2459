"""The code paths numba compiles the CPU kernels to, and running tests on each of them whatever the host.

numba compiles for the CPU that NUMBA_CPU_NAME and NUMBA_CPU_FEATURES name (NUMBA_CPU_NAME alone keeps the
host's features), so a process told "haswell" with AVX2's features runs the kernels' AVX2 variants (16
vector registers of 8 floats) even on an AVX-512 machine, and one told "x86-64" with no features runs
baseline code (SSE2; every vector FMA a libm call). numba_setup.CODE_PATH reads back what was compiled.

As a script this is CI's second half (.ci/run, after the README's test command): the tests whose results
depend on the compiled code (FORCED_TESTS) run again on each code path other than the host's own that the
host can execute; a path it cannot execute (AVX-512 on an AVX2 CPU) is skipped with a printed line.

    python tests/code_paths.py            # every forced pass this host can run
    python tests/code_paths.py --list     # what would run, and why, without running it
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

AVX2_FEATURES = "+avx,+avx2,+fma,+sse4.2,+popcnt,+bmi,+bmi2,+f16c,+lzcnt,+movbe,+xsave"
AVX512_FEATURES = AVX2_FEATURES + ",+avx512f,+avx512cd,+avx512bw,+avx512dq,+avx512vl"
# What a process needs in its environment to compile for each path; a host must have `needs` to run it.
FORCED = {
    "avx512": dict(env={"NUMBA_CPU_NAME": "skylake-avx512", "NUMBA_CPU_FEATURES": AVX512_FEATURES},
                   needs=("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma")),
    "avx2": dict(env={"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": AVX2_FEATURES}, needs=("avx2", "fma")),
    "baseline": dict(env={"NUMBA_CPU_NAME": "x86-64", "NUMBA_CPU_FEATURES": ""}, needs=()),
}
# The tests whose results depend on the code numba compiled: every kernel and model test, and the runtime tests
# that compare tokens or bits across batches, forks, caches and ranks. The CUDA sources' compile and host
# emulation checks (C++ and nvcc, not numba) and the GPU-only files are left out.
FORCED_TESTS = ["tests/cupy_kernels", "tests/models", "tests/runtime/test_sampler.py",
                "tests/runtime/test_engine.py", "tests/runtime/test_prefix_cache.py",
                "tests/runtime/test_parallel_and_beam.py", "tests/runtime/test_spec_decode.py",
                "tests/runtime/test_tensor_parallel.py", "tests/lora/test_lora_goldens.py",
                "tests/lora/test_lora_forward.py"]
# Also left out: the packaged Gemma 3 270M's goldens (the kernels they run are the tiny families' goldens',
# which are forced; at 2,300 tokens they take minutes a pass, many more on baseline code).
NOT_FORCED = ["tests/cupy_kernels/test_nvcc_compile.py", "tests/cupy_kernels/test_kernels_on_host.py",
              "tests/cupy_kernels/test_gpu_scripts.py", "tests/cupy_kernels/test_cuda_ops.py",
              "tests/cupy_kernels/test_gpu_runtime.py", "tests/cupy_kernels/test_mma_emulation.py",
              "tests/cupy_kernels/test_prefill_tc_gpu.py", "tests/models/test_gemma3_packaged_golden.py"]


def forced_env(path: str, cache_dir: Path | None = None) -> dict[str, str]:
    """This process's environment, compiling for `path` ("avx512", "avx2" or "baseline"), with the suite's
    helpers on the path and, when given, a numba cache of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    env.update(FORCED[path]["env"])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = str(cache_dir)
    return env


def run_as(path: str, script: str, cache_dir: Path) -> subprocess.CompletedProcess:
    """Run `script` with `python -c`, compiled for `path`; returns the finished process."""
    return subprocess.run([sys.executable, "-c", script], env=forced_env(path, cache_dir), capture_output=True,
                          text=True, timeout=300)


def run_as_avx2(script: str, cache_dir: Path) -> subprocess.CompletedProcess:
    return run_as("avx2", script, cache_dir)


def host_features() -> set[str]:
    from llvmlite import binding

    return {name for name, on in binding.get_host_cpu_features().items() if on}


def host_code_path() -> str:
    """The path numba compiles for in a process with neither variable set: the host's own."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    out = subprocess.run([sys.executable, "-c", "from pagedserve.cupy_kernels.numba_cpu.setup import CODE_PATH; "
                          "print(CODE_PATH)"], env=env, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


def plan() -> list[tuple[str, str]]:
    """(path, what to do: "run" or the reason it is not run) for every path, in order."""
    own, features = host_code_path(), host_features()
    steps = []
    for path, spec in FORCED.items():
        missing = [f for f in spec["needs"] if f not in features]
        if path == own:
            steps.append((path, "not forced: this CPU's own code path, tested by the suite above"))
        elif missing:
            steps.append((path, f"SKIPPED: this CPU cannot execute it (no {', '.join(missing)})"))
        else:
            steps.append((path, "run"))
    return steps


def check_forced(path: str) -> str:
    """What numba compiles for under `path`'s environment (must be `path` itself)."""
    out = subprocess.run([sys.executable, "-c", "from pagedserve.cupy_kernels.numba_cpu.setup import CODE_PATH; "
                          "print(CODE_PATH)"], env=forced_env(path), capture_output=True, text=True, timeout=120,
                         check=True)
    return out.stdout.strip().splitlines()[-1]


def main(argv: list[str]) -> int:
    if sys.platform != "linux" or os.uname().machine not in ("x86_64", "AMD64"):
        print(f"code paths: {os.uname().machine} is not x86-64; only the suite above ran (its own code path)")
        return 0
    steps = plan()
    for path, what in steps:
        if what == "run":
            what = "forced: " + " ".join(f"{k}={v}" for k, v in FORCED[path]["env"].items())
        print(f"code path {path}: {what}", flush=True)
    if "--list" in argv:
        return 0
    failed = []
    for path, what in steps:
        if what != "run":
            continue
        compiled = check_forced(path)
        if compiled != path:
            print(f"code path {path}: numba compiled for {compiled!r} under the forced environment", flush=True)
            failed.append(path)
            continue
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", *FORCED_TESTS,
                *(f"--ignore={t}" for t in NOT_FORCED)]
        print(f"\n=== code path {path}: {' '.join(FORCED_TESTS)}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run(args, env=forced_env(path), cwd=ROOT).returncode
        print(f"=== code path {path}: pytest exit {rc} in {time.monotonic() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(path)
    if failed:
        print(f"code paths failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
