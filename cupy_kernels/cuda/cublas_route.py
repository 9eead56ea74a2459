"""Which GEMM the CUDA op table's `linear` calls: ours through ctypes, ours through nvmath-python, or CuPy's.

The rule (`pick_route`), the same in scripts/gpu_gemm_probe.py and at run time: probe the routes in
ROUTES' order - ctypes first (no dependency beyond libcublas, which CuPy already loads), then nvmath-python
(NVIDIA's own bindings, when the image has them) - and take the first that loads, multiplies eagerly to
float16 rounding of a float64 product, is recorded by a stream capture, and replays the graph onto new
inputs correctly. None does: CuPy's `x @ w` (its cuBLAS calls cannot be captured: decode graphs then fail
at capture and the engine runs eagerly, as before).

$PAGEDSERVE_GEMM overrides: "auto" (the default: the rule), "ctypes", "nvmath", "cupy". A named route that
fails to load raises: it was asked for.

The probe costs one small capture, once per process and device, on the first `linear` (the model's first
forward: eager, before any graph is captured). The workspace is a plain cudaMalloc (cublas.make_cupy_gemm),
outside every memory pool, so a graph pool's arena or a throw-away warm-up pool never owns it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import numpy as np

from .cublas import CublasGemm, make_cupy_gemm

ROUTES = ("ctypes", "nvmath")
ENV = "PAGEDSERVE_GEMM"
SETTINGS = ("auto", *ROUTES, "cupy")
_log = logging.getLogger("pagedserve.kernels")
_chosen: dict[tuple[int, int], tuple[str, CublasGemm | None]] = {}


def pick_route(results: list[dict]) -> str:
    """The first route (in ROUTES' order) whose probe passed every step; "cupy" when none did."""
    by_route = {r["route"]: r for r in results}
    for route in ROUTES:
        r = by_route.get(route)
        if r and r.get("eager_ok") and r.get("capture_ok") and r.get("replay_ok"):
            return route
    return "cupy"


def _close_enough(got: np.ndarray, x: np.ndarray, w: np.ndarray) -> tuple[bool, float]:
    """Within float16 rounding of the float64 product (float32 accumulation): |err| <= 2e-3 (|x| @ |w|)."""
    ref = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)) + 1e-30
    err = np.abs(got.astype(np.float64) - ref) / scale
    return bool(np.isfinite(got).all() and err.max() <= 2e-3), float(err.max())


def probe_route(route: str, cupy: Any, m: int = 8, k: int = 512, n: int = 384, timing_calls: int = 0) -> dict:
    """Load `route`, multiply once eagerly, capture one GEMM into a graph on a private stream, replay it onto
    new inputs: a dict of what worked (and the first error). Never raises. timing_calls > 0 (the probe script):
    also the wall time per call of that many eager calls and of as many graph launches, host time included."""
    out: dict[str, Any] = {"route": route, "loaded": False, "eager_ok": False, "capture_ok": False,
                           "replay_ok": False, "error": None}
    g = None
    t0 = time.perf_counter()
    try:
        g = make_cupy_gemm(route)
        out["loaded"] = True
        out["cublas_version"] = g.version()
        rng = np.random.default_rng(0)
        xh = rng.standard_normal((m, k)).astype(np.float16)
        wh = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16).T  # F-ordered, as a tied lm_head is
        x, w = cupy.asarray(xh), cupy.asfortranarray(cupy.asarray(wh))
        y = cupy.empty((m, n), dtype=cupy.float16)
        g.matmul(x, w, out=y)
        cupy.cuda.Device().synchronize()
        out["eager_ok"], out["eager_rel_err"] = _close_enough(y.get(), xh, wh)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:  # eagerly on the capture stream first, as a graph's warm-up does: the stream is set outside
            g.matmul(x, w, out=y)
        stream.synchronize()
        with stream:
            stream.begin_capture()
            try:
                g.matmul(x, w, out=y)
            finally:
                graph = stream.end_capture()
        out["capture_ok"] = True
        xh2 = rng.standard_normal((m, k)).astype(np.float16)
        x.set(xh2)
        y.fill(np.nan)
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        out["replay_ok"], out["replay_rel_err"] = _close_enough(y.get(), xh2, wh)
        if timing_calls:
            with stream:
                for label, call in (("eager_call_us", lambda: g.matmul(x, w, out=y)),
                                    ("graph_launch_us", lambda: graph.launch(stream))):
                    stream.synchronize()
                    t1 = time.perf_counter()
                    for _ in range(timing_calls):
                        call()
                    stream.synchronize()
                    out[label] = round((time.perf_counter() - t1) / timing_calls * 1e6, 2)
    except Exception as e:  # noqa: BLE001 - a probe reports, the caller decides
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if g is not None:
            g.close()
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def current_gemm() -> CublasGemm | None:
    """The GEMM `linear` uses on this device (None: CuPy's matmul), chosen on the first call."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        import cupy
    key = (id(cupy), cupy.cuda.runtime.getDevice())
    hit = _chosen.get(key)
    if hit is not None:
        return hit[1]
    setting = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if setting not in SETTINGS:
        raise ValueError(f"{ENV}={setting!r}: expected one of {', '.join(SETTINGS)}")
    results: list[dict] = []
    if setting == "auto":
        for route in ROUTES:
            results.append(probe_route(route, cupy))
            if pick_route(results) == route:
                break
        route = pick_route(results)
    else:
        route = setting
    gemm = None if route == "cupy" else make_cupy_gemm(route)
    _chosen[key] = (route, gemm)
    _log.info("gemm route %s (%s=%s; probes: %s)", route, ENV, setting,
              [(r["route"], r["error"] or "ok") for r in results])
    return gemm


def chosen_route() -> str | None:
    """The route chosen on the current CuPy and device, None before the first `linear`."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    hit = _chosen.get((id(cupy), cupy.cuda.runtime.getDevice()))
    return hit[0] if hit else None
