"""cublas_route.py's rule and its run-time choice, without a GPU (the probe itself: scripts/gpu_gemm_probe.py)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

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


# ---------------------------------------------------------------------------------------------
# The probe itself, on a stand-in CuPy over the fake libcublas (whose capture records GEMMs and whose
# replay runs them): the eager check, the capture and the replay onto new inputs, as on a device.
# ---------------------------------------------------------------------------------------------

GCC = shutil.which("gcc")


@pytest.fixture(scope="module")
def fake_libcublas(tmp_path_factory):
    if GCC is None:
        pytest.skip("gcc not found (needed to build the fake libcublas)")
    so = tmp_path_factory.mktemp("fake_cublas") / "libcublas.so.13"
    src = Path(__file__).with_name("_fake_cublas.c")
    proc = subprocess.run([GCC, "-O1", "-fPIC", "-shared", "-o", str(so), str(src)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return so


class _DeviceArray(np.ndarray):
    __module__ = "cupy_probe_stand_in"

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    def get(self):
        return np.array(self.view(np.ndarray))

    def set(self, a):
        np.copyto(self.view(np.ndarray), a)


def _probe_cupy(lib, replays: bool):
    cp = types.ModuleType("cupy")
    cp.float16, cp.uint8 = np.float16, np.uint8
    cp.asarray = lambda a: np.array(a).view(_DeviceArray)
    cp.asfortranarray = lambda a: np.asfortranarray(a).view(_DeviceArray)
    cp.empty = lambda shape, dtype: np.empty(shape, dtype).view(_DeviceArray)
    buffers = {}

    def malloc(n):
        b = np.zeros(n, np.uint8)
        buffers[b.ctypes.data] = b
        return b.ctypes.data

    class Stream:
        current = None

        def __init__(self, non_blocking=False, ptr=0x5100):
            self.ptr = ptr

        def __enter__(self):
            self.outer, Stream.current = Stream.current, self

        def __exit__(self, *exc):
            Stream.current = self.outer

        def begin_capture(self):
            lib.fake_cublas_capture(1)

        def end_capture(self):
            lib.fake_cublas_capture(0)
            return types.SimpleNamespace(launch=lambda stream=None: lib.fake_cublas_replay() if replays else None)

        def synchronize(self):
            pass

    null = Stream(ptr=0)
    cp.cuda = types.SimpleNamespace(
        Stream=Stream, Device=lambda: types.SimpleNamespace(synchronize=lambda: None),
        get_current_stream=lambda: Stream.current or null, device=types.SimpleNamespace(get_cublas_handle=lambda: None),
        runtime=types.SimpleNamespace(malloc=malloc, free=lambda p: buffers.pop(p), getDevice=lambda: 0))
    return cp, buffers


@pytest.mark.parametrize("replays", [True, False])
def test_the_probe_captures_replays_and_checks_on_a_stand_in_device(fake_libcublas, monkeypatch, replays):
    from pagedserve.cupy_kernels.cuda import cublas

    monkeypatch.setenv("PAGEDSERVE_LIBCUBLAS", str(fake_libcublas))
    lib = cublas.load_library(str(fake_libcublas))
    lib.fake_cublas_log.restype = ctypes.c_char_p
    lib.fake_cublas_reset()
    cp, buffers = _probe_cupy(lib, replays)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    r = cublas_route.probe_route("ctypes", cp, m=4, k=64, n=24)
    assert r["error"] is None, r
    assert r["loaded"] and r["eager_ok"] and r["capture_ok"] and r["cublas_version"] == 130000
    assert r["replay_ok"] is replays  # a graph that does not run leaves NaN in the output: the probe sees it
    assert buffers == {}  # the workspace went back when the probe closed its handle
    log = lib.fake_cublas_log().decode().splitlines()
    streams = [line for line in log if line.startswith("stream")]
    assert streams == ["stream 0", "stream 20736"]  # the default stream, then the capture stream before capturing
    assert cublas_route.pick_route([r]) == ("ctypes" if replays else "cupy")


def test_the_probe_script_reports_the_routes_and_what_linear_chose(fake_libcublas, monkeypatch):
    """scripts/gpu_gemm_probe.py's run() on the stand-in: every route probed (nvmath absent here), the rule's
    choice, and the op table's `linear` taking that same route in the process."""
    import runpy

    from pagedserve.cupy_kernels.cuda import cublas

    monkeypatch.setenv("PAGEDSERVE_LIBCUBLAS", str(fake_libcublas))
    monkeypatch.delenv(cublas_route.ENV, raising=False)
    monkeypatch.setattr(cublas_route, "_chosen", {})
    monkeypatch.setitem(sys.modules, "nvmath", None)  # not installed: the nvmath route reports it
    lib = cublas.load_library(str(fake_libcublas))
    cp, _ = _probe_cupy(lib, replays=True)
    cp.__version__ = "stand-in"
    cp.ones = lambda shape, dtype: np.ones(shape, dtype).view(_DeviceArray)
    cp.cuda.runtime.getDeviceCount = lambda: 1
    cp.cuda.runtime.getDeviceProperties = lambda d: {"name": b"Stand-in GPU"}
    monkeypatch.setitem(sys.modules, "cupy", cp)
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_gemm_probe.py"
    result = runpy.run_path(str(script), run_name="gpu_gemm_probe_under_test")["run"]()
    routes = {r["route"]: r for r in result["routes"]}
    assert routes["ctypes"]["replay_ok"] and not routes["nvmath"]["loaded"] and "nvmath" in routes["nvmath"]["error"]
    assert routes["ctypes"]["eager_call_us"] > 0 and routes["ctypes"]["graph_launch_us"] > 0
    assert result["chosen"] == "ctypes" and result["linear_route"] == "ctypes" and result["device"] == "Stand-in GPU"
