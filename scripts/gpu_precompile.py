"""Compile one model's CUDA kernel modules ahead, and time each: one JSON object on stdout.

    python scripts/gpu_precompile.py --dtype f16 --head-dim 128 64         # GPU machine: NVRTC into the kernel cache
    python scripts/gpu_precompile.py --nvcc --dtype f16 bf16 --head-dim 128 # here: nvcc -cubin -arch=sm_90, cold

The modules are cupy_kernels/cuda/modules.py's `model_modules(dtype, head_dim)`: the attention modules of that
storage type and head dim, and the elementwise families. Without --nvcc each is compiled by NVRTC through the
kernel cache (kernel_cache.py; $PAGEDSERVE_CACHE_DIR), so the processes that follow (the GPU tests, the
benchmarks) load the binaries instead of compiling: scripts/gpu_check.sh runs this while the GEMM probe runs.
With --nvcc (no GPU, no CuPy) each module is compiled cold by nvcc for --arch, the figure the issue's goal is
read against. --jobs N compiles N modules at a time (separate processes); `sequential_s` is the sum of the
modules' figures, `wall_s` what the run took.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

try:
    from pagedserve.cupy_kernels.cuda import modules as mods
except ImportError:
    sys.exit("scripts/gpu_precompile.py: pagedserve is not importable (pip install -e . or see scripts/gpu_check.sh)")


def nvcc_source(module: "mods.KernelModule") -> str:
    """The module's source plus one line per name expression that makes nvcc instantiate it (as NVRTC does)."""
    lines = [module.source(), ""]
    lines += [f"auto pagedserve_instance_{i} = &{expr};" for i, expr in enumerate(module.name_expressions)]
    return "\n".join(lines) + "\n"


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for candidate in ("/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def nvcc_compile(name: str, arch: str, nvcc: str) -> dict:
    module = mods.MODULES[name]
    with tempfile.TemporaryDirectory(prefix="pagedserve_nvcc_") as work:
        src = Path(work) / f"{name}.cu"
        src.write_text(nvcc_source(module))
        cmd = [nvcc, f"-arch={arch}", "-cubin", "-o", str(Path(work) / f"{name}.cubin"), *mods.NVRTC_OPTIONS,
               *mods.CUPY_IMPLICIT_OPTIONS, str(src)]
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        seconds, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    # cpu_s: nvcc's own CPU time (its children's user + system): what a contended machine's wall figure overstates
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    out = {"module": name, "instantiations": len(module.name_expressions), "seconds": round(seconds, 2),
           "cpu_s": round(cpu, 2), "ok": proc.returncode == 0}
    if proc.returncode:
        out["error"] = (proc.stdout + proc.stderr)[-2000:]
    return out


def nvrtc_compile(name: str) -> dict:
    """Through the kernel cache, as the run's first _kernel() call would: a hit costs a file read."""
    from pagedserve.cupy_kernels.cuda import kernel_cache

    module = mods.MODULES[name]
    cache = mods._make_kernel_cache()
    t0 = time.perf_counter()
    try:
        cache.get(module.source(), mods.NVRTC_OPTIONS + mods.CUPY_IMPLICIT_OPTIONS, kernel_cache.device_arch(),
                  module.name_expressions)
        ok, error = True, None
    except Exception as e:  # noqa: BLE001 - reported, the run goes on (the kernel then compiles on first use)
        ok, error = False, f"{type(e).__name__}: {e}"[-2000:]
    out = {"module": name, "instantiations": len(module.name_expressions),
           "seconds": round(time.perf_counter() - t0, 2), "ok": ok, "cache_hit": cache.hits == 1}
    if error:
        out["error"] = error
    return out


def module_names(dtypes: list[str], head_dims: list[int], skip: list[str] = ()) -> list[str]:
    """The modules of every (dtype, head dim) model, in order, once each, less those of the `skip` models
    ("f16:128")."""
    left_out = {name for pair in skip for name in mods.model_modules(pair.split(":")[0], int(pair.split(":")[1]))}
    names: list[str] = []
    for dtype, head_dim in ((d, h) for d in dtypes for h in head_dims):
        for name in mods.model_modules(dtype, head_dim):
            if name not in names and name not in left_out:
                names.append(name)
    return names


def run(args: argparse.Namespace) -> dict:
    names = module_names(args.dtype, args.head_dim, args.skip_dtype_head_dim)
    t0 = time.perf_counter()
    if args.nvcc:
        nvcc = find_nvcc()
        if nvcc is None:
            return {"ok": False, "error": "nvcc not found"}
        jobs = [(nvcc_compile, (n, args.arch, nvcc)) for n in names]
        compiler = f"nvcc -cubin -arch={args.arch}"
    else:
        jobs = [(nvrtc_compile, (n,)) for n in names]
        compiler = "NVRTC through the kernel cache"
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(fn, *a) for fn, a in jobs]
        modules = [f.result() for f in futures]
    for m in modules:
        cpu = f", {m['cpu_s']} s of CPU" if "cpu_s" in m else ""
        print(f"gpu_precompile: {m['module']}: {m['seconds']} s{cpu} ({m['instantiations']} instantiations)"
              + ("" if m["ok"] else " FAILED"), file=sys.stderr)
    return {"ok": all(m["ok"] for m in modules), "compiler": compiler, "dtypes": args.dtype,
            "head_dim": args.head_dim, "jobs": args.jobs, "modules": modules,
            "sequential_s": round(sum(m["seconds"] for m in modules), 2),
            **({"cpu_s": round(sum(m["cpu_s"] for m in modules), 2)} if args.nvcc else {}),
            "wall_s": round(time.perf_counter() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["f16"], choices=mods.ATTN_TYPES)
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128], choices=mods.ATTN_HEAD_DIMS)
    ap.add_argument("--nvcc", action="store_true", help="compile with nvcc here (no GPU) instead of NVRTC")
    ap.add_argument("--arch", default="sm_90", help="with --nvcc: the architecture")
    ap.add_argument("--jobs", type=int, default=1, help="modules compiled at a time")
    ap.add_argument("--skip-dtype-head-dim", nargs="*", default=[], metavar="DTYPE:HEAD_DIM",
                    help="leave out the modules of these models (another run compiles them)")
    args = ap.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
