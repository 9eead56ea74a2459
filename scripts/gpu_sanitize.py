"""One prefill and one paged decode attention case under compute-sanitizer's racecheck and memcheck: one JSON object.

    python scripts/gpu_sanitize.py [--budget SECONDS]   # the GPU machine (scripts/gpu_check.sh's sanitizer step)
    python scripts/gpu_sanitize.py --dry-run           # anywhere: the cases exist, the commands it would run

The cases are two GPU tests (each checks its result against numpy too): the tensor-core prefill at head dim 128
with a sliding window, and paged attention at head dim 128 (float16: the modules scripts/gpu_precompile.py puts in
the kernel cache first, so the sanitizer times kernels, not NVRTC). Each (tool, case) runs under
`compute-sanitizer --tool T --error-exitcode 86` with its share of the budget; its summary line, exit status and
output tail are reported. Where the image has no compute-sanitizer the step is skipped with that reason (not a
failure); a hazard, a memory error, or a case failing under the tool sets "ok": false.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "prefill": "tests/cupy_kernels/test_prefill_tc_gpu.py::test_prefill_attention_tensor_cores_gpu[128-16-4-100-f16]",
    "paged_decode": "tests/cupy_kernels/test_cuda_ops.py::test_paged_attention_matches_reference[128-16-4]",
}
TOOLS = ("racecheck", "memcheck")
ERROR_EXIT = 86
SUMMARY = re.compile(r"(ERROR SUMMARY: .*|RACECHECK SUMMARY: .*)")


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for home in filter(None, homes):
        candidate = Path(home) / "bin" / "compute-sanitizer"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def command(sanitizer: str, tool: str, case: str) -> list[str]:
    return [sanitizer, "--tool", tool, "--error-exitcode", str(ERROR_EXIT), "--print-limit", "20",
            sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "gpu", CASES[case]]


def read_run(tool: str, case: str, rc: int | None, output: str, seconds: float) -> dict:
    summary = SUMMARY.findall(output)
    hazards = re.search(r"(\d+) hazards? displayed", output)
    errors = re.search(r"ERROR SUMMARY: (\d+) error", output)
    out = {"tool": tool, "case": case, "test": CASES[case], "exit_code": rc, "seconds": round(seconds, 1),
           "summary": summary[-1] if summary else None}
    if rc is None:
        out["state"] = "timed out"
    elif rc == ERROR_EXIT or (hazards and int(hazards.group(1))) or (errors and int(errors.group(1))):
        out["state"] = "found problems"
    elif rc != 0:
        out["state"] = "the case failed"
    elif not re.search(r"\b1 passed", output):
        out["state"] = "the case failed"  # skipped or deselected under the tool: it checked nothing
    else:
        out["state"] = "clean"
    if out["state"] != "clean":
        out["output_tail"] = output.splitlines()[-40:]
    return out


def run(budget: float) -> dict:
    sanitizer = find_sanitizer()
    if sanitizer is None:
        return {"skipped": "compute-sanitizer is not on this image (looked on PATH, $CUDA_HOME/bin, "
                           "$CUDA_PATH/bin, /usr/local/cuda/bin)", "cases": CASES}
    version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    jobs = [(tool, case) for tool in TOOLS for case in CASES]
    deadline = time.monotonic() + budget
    runs = []
    for i, (tool, case) in enumerate(jobs):
        share = (deadline - time.monotonic()) / (len(jobs) - i)
        if share < 3:
            runs.append({"tool": tool, "case": case, "state": "not run: the budget ran out"})
            continue
        t0 = time.monotonic()
        try:
            proc = subprocess.run(command(sanitizer, tool, case), capture_output=True, text=True, timeout=share,
                                  cwd=ROOT)
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = None
            output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        runs.append(read_run(tool, case, rc, output, time.monotonic() - t0))
        print(f"gpu_sanitize: {tool} {case}: {runs[-1]['state']} ({runs[-1].get('summary')})", file=sys.stderr)
    bad = [r for r in runs if r["state"] in ("found problems", "the case failed")]
    return {"ok": not bad, "sanitizer": sanitizer, "version": version[-1] if version else None, "runs": runs,
            "clean": sum(r["state"] == "clean" for r in runs), "of": len(runs)}


def dry_run() -> dict:
    """The wiring without a GPU: the cases collect, and the commands as they would run."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "-m",
                           "gpu", *CASES.values()], capture_output=True, text=True, cwd=ROOT)
    collected = [line.strip() for line in proc.stdout.splitlines() if "::" in line]
    missing = [c for c in CASES.values() if c not in collected]
    sanitizer = find_sanitizer()
    return {"ok": not missing and proc.returncode == 0, "missing_cases": missing, "collected": collected,
            "sanitizer": sanitizer or "absent here: the step would be skipped with that reason",
            "commands": [" ".join(command(sanitizer or "compute-sanitizer", t, c)) for t in TOOLS for c in CASES]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=60.0, help="seconds for every run together")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    result = dry_run() if args.dry_run else run(args.budget)
    print(json.dumps(result, indent=2), flush=True)
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
