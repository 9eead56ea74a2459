"""Which cuBLAS route a CUDA graph can record, on this device: one JSON object on stdout.

For each route of cupy_kernels/cuda/cublas_route.py (ctypes: our libcublas binding; nvmath: nvmath-python's
bindings), with its own handle, stream and workspace: load it, multiply a float16 [8, 512] x [512, 384]
(F-ordered weight, as a tied lm_head) eagerly, capture the same GEMM on a private stream, replay the graph
onto new inputs, and check both against float64 on the host; then the wall time per call of 200 eager
GEMMs and of 200 launches of that one-GEMM graph. Also CuPy's own matmul inside a capture (the refusal of
2026-12-04, kept as the control). `chosen` is what the run-time rule (`pick_route`) takes, and
`linear_route` what the op table's `linear` actually chose in this process.

    python scripts/gpu_gemm_probe.py      # exit 0 when a capturable route exists, 1 when none, 2 without a GPU

With $GPU_STEP_PARTIAL set (scripts/gpu_check.sh sets it), what is known so far is written there after every
route, so a probe killed at its cap still reports the routes it finished.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from common import emit_json  # noqa: E402

try:
    from pagedserve.cupy_kernels.cuda import cublas_route  # noqa: E402
except ImportError:
    sys.exit("scripts/gpu_gemm_probe.py: pagedserve is not importable (pip install -e . or see scripts/gpu_check.sh)")


def cupy_capture(cp) -> dict:
    """CuPy's own `a @ b` inside a stream capture: the control."""
    out = {"route": "cupy", "capture_ok": False, "error": None}
    a = cp.ones((8, 64), dtype=cp.float16)
    a @ a.T  # eager: cuBLAS initialised outside the capture
    stream = cp.cuda.Stream(non_blocking=True)
    try:
        with stream:
            stream.begin_capture()
            try:
                a @ a.T
            finally:
                stream.end_capture()
        out["capture_ok"] = True
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def save_partial(result: dict) -> None:
    """What is known so far, to $GPU_STEP_PARTIAL (written whole, then renamed: never half a file)."""
    path = os.environ.get("GPU_STEP_PARTIAL")
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def run() -> dict:
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as e:  # noqa: BLE001
        return {"probe": "gemm_capture", "error": f"no usable GPU: {type(e).__name__}: {e}", "chosen": None}
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    partial = {"probe": "gemm_capture", "cupy": cp.__version__, "routes": [], "unfinished": list(cublas_route.ROUTES)}
    save_partial(partial)
    results = []
    for route in cublas_route.ROUTES:
        results.append(cublas_route.probe_route(route, cp, timing_calls=200))
        partial["routes"] = results
        partial["unfinished"] = [r for r in cublas_route.ROUTES if r not in {x.get("route") for x in results}]
        save_partial(partial)
    from pagedserve.cupy_kernels.cuda import ops

    x = cp.ones((4, 32), dtype=cp.float16)
    ops.linear(x, cp.ones((32, 16), dtype=cp.float16))  # the op table's own choice, as a model's first forward
    return {
        "probe": "gemm_capture",
        "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "cupy": cp.__version__,
        "routes": results,
        "cupy_matmul_in_capture": cupy_capture(cp),
        "rule": "first of " + ", ".join(cublas_route.ROUTES) + " with eager, capture and replay all correct; "
                "else cupy (no graphs)",
        "chosen": cublas_route.pick_route(results),
        "linear_route": cublas_route.chosen_route(),
        "env": os.environ.get(cublas_route.ENV, "auto"),
    }


def main() -> None:
    result: dict = {}

    def keep():
        result.update(run())
        return result

    emit_json(keep)
    if result.get("chosen") is None:
        sys.exit(2)
    sys.exit(0 if result["chosen"] != "cupy" else 1)


if __name__ == "__main__":
    main()
