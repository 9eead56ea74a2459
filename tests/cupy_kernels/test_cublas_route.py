"""cublas_route.py's rule and its run-time choice, without a GPU (the probe itself: scripts/gpu_gemm_probe.py)."""

from __future__ import annotations

import sys
import types

import pytest

from pagedserve.cupy_kernels.cuda import cublas_route


def _ok(route):
    return {"route": route, "eager_ok": True, "capture_ok": True, "replay_ok": True, "error": None}


def test_rule_prefers_ctypes_then_nvmath_and_needs_every_step():
    assert cublas_route.pick_route([_ok("nvmath"), _ok("ctypes")]) == "ctypes"
    assert cublas_route.pick_route([{**_ok("ctypes"), "replay_ok": False}, _ok("nvmath")]) == "nvmath"
    assert cublas_route.pick_route([{**_ok("ctypes"), "capture_ok": False}]) == "cupy"
    assert cublas_route.pick_route([{**_ok("ctypes"), "eager_ok": False}, {**_ok("nvmath"), "loaded": False,
                                                                            "eager_ok": False}]) == "cupy"
    assert cublas_route.pick_route([]) == "cupy"


@pytest.fixture
def fake_cupy(monkeypatch):
    cp = types.ModuleType("cupy")
    cp.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(cublas_route, "_chosen", {})
    return cp


def test_auto_probes_in_order_stops_at_the_first_good_route_and_chooses_once(fake_cupy, monkeypatch):
    probed, made = [], []
    monkeypatch.setattr(cublas_route, "probe_route", lambda r, cp: probed.append(r) or _ok(r))
    monkeypatch.setattr(cublas_route, "make_cupy_gemm", lambda r: made.append(r) or f"gemm:{r}")
    monkeypatch.delenv(cublas_route.ENV, raising=False)
    assert cublas_route.current_gemm() == "gemm:ctypes"
    assert cublas_route.current_gemm() == "gemm:ctypes"
    assert probed == ["ctypes"] and made == ["ctypes"] and cublas_route.chosen_route() == "ctypes"


def test_auto_falls_back_to_cupys_matmul_when_no_route_captures(fake_cupy, monkeypatch):
    monkeypatch.setattr(cublas_route, "probe_route",
                        lambda r, cp: {**_ok(r), "capture_ok": False, "error": "NotImplementedError: x"})
    monkeypatch.setattr(cublas_route, "make_cupy_gemm", lambda r: pytest.fail("no route passed; nothing to make"))
    monkeypatch.delenv(cublas_route.ENV, raising=False)
    assert cublas_route.current_gemm() is None and cublas_route.chosen_route() == "cupy"


def test_the_real_probe_reports_instead_of_raising_without_a_gpu(fake_cupy):
    """On a machine with no cuBLAS/GPU (here: a stand-in cupy) the probe says what failed, and auto picks cupy."""
    r = cublas_route.probe_route("ctypes", fake_cupy)
    assert not r["loaded"] and r["error"]
    assert cublas_route.current_gemm() is None


def test_setting_names_a_route_or_is_refused(fake_cupy, monkeypatch):
    monkeypatch.setattr(cublas_route, "make_cupy_gemm", lambda r: f"gemm:{r}")
    monkeypatch.setattr(cublas_route, "probe_route", lambda r, cp: pytest.fail("a named route is not probed"))
    monkeypatch.setenv(cublas_route.ENV, "nvmath")
    assert cublas_route.current_gemm() == "gemm:nvmath"
    monkeypatch.setattr(cublas_route, "_chosen", {})
    monkeypatch.setenv(cublas_route.ENV, "cupy")
    assert cublas_route.current_gemm() is None
    monkeypatch.setattr(cublas_route, "_chosen", {})
    monkeypatch.setenv(cublas_route.ENV, "cutlass")
    with pytest.raises(ValueError, match="PAGEDSERVE_GEMM='cutlass': expected one of auto, ctypes, nvmath, cupy"):
        cublas_route.current_gemm()
