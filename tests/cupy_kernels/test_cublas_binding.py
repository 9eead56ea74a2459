"""cupy_kernels/cuda/cublas.py without a GPU: the ctypes binding driven against a fake libcublas.

tests/cupy_kernels/_fake_cublas.c exports the symbols the binding uses with cuBLAS's C signatures, logs
every call, and computes cublasGemmEx's column-major GEMM on host memory. Host pointers of numpy arrays
stand in for device pointers, so the binding's row-major -> column-major marshalling (which operand is A,
the ops, m/n/k, the leading dimensions), the type table and the handle's stream/workspace order are all
checked against numpy. What only a device shows (that cuBLAS really captures into a graph, and replays):
scripts/gpu_gemm_probe.py. Skipped when gcc is absent.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from pagedserve.cupy_kernels.cuda import cublas

GCC = shutil.which("gcc")
pytestmark = pytest.mark.skipif(GCC is None, reason="gcc not found (needed to build the fake libcublas)")
STREAM_A, STREAM_B, WORKSPACE = 0x1111, 0x2222, 0x7000


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory):
    so = tmp_path_factory.mktemp("fake_cublas") / "libcublas.so.13"
    src = Path(__file__).with_name("_fake_cublas.c")
    proc = subprocess.run([GCC, "-O1", "-fPIC", "-shared", "-o", str(so), str(src)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lib = cublas.load_library(str(so))
    lib.fake_cublas_log.restype = ctypes.c_char_p
    return lib


def _log(lib) -> list[str]:
    return lib.fake_cublas_log().decode().splitlines()


@pytest.fixture
def gemm(fake_lib):
    fake_lib.fake_cublas_reset()
    g = cublas.CublasGemm(fake_lib, WORKSPACE, 1 << 20)
    yield g
    g.close()


def _matmul(g: cublas.CublasGemm, x: np.ndarray, w: np.ndarray, stream: int = STREAM_A) -> np.ndarray:
    """CublasGemm.matmul's steps on numpy arrays (host pointers for device pointers)."""
    out = np.full((x.shape[0], w.shape[1]), np.nan, dtype=x.dtype)
    item = x.itemsize
    plan = cublas.plan_gemm(x.shape, [s // item for s in x.strides], w.shape, [s // item for s in w.strides],
                            [s // item for s in out.strides])
    g.gemm_ptrs(x.dtype, plan, x.ctypes.data, w.ctypes.data, out.ctypes.data, stream)
    return out


def _layouts(rng, m, k, n, dtype):
    """(name, x, w): C-contiguous operands, the tied lm_head's F-ordered weight (an embedding's transposed
    view), and x a view of every other column block of a wider array (row stride > K)."""
    x = rng.standard_normal((m, k)).astype(dtype)
    w = rng.standard_normal((k, n)).astype(dtype)
    wide = rng.standard_normal((m, k + 5)).astype(dtype)
    emb = rng.standard_normal((n, k)).astype(dtype)
    return [("c", x, w), ("f_weight", x, emb.T), ("strided_rows", wide[:, 2:2 + k], w),
            ("f_x", np.asfortranarray(x), w)]


TOL = {np.float16: 2e-3, np.float32: 1e-5, np.float64: 1e-12}


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (7, 33, 5), (16, 1, 9), (5, 17, 1), (1, 1, 1)])
def test_row_major_gemm_through_column_major_cublas_matches_numpy(gemm, dtype, m, k, n):
    rng = np.random.default_rng(m * 100 + k + n)
    for name, x, w in _layouts(rng, m, k, n, dtype):
        got = _matmul(gemm, x, w)
        ref = x.astype(np.float64) @ w.astype(np.float64)
        scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)) + 1e-30
        assert np.all(np.abs(got - ref) <= TOL[dtype] * scale), (name, dtype, m, k, n)


def test_the_arguments_cublas_receives(gemm, fake_lib):
    x = np.ones((3, 4), np.float16)
    w = np.ones((4, 5), np.float16)
    _matmul(gemm, x, w)
    gemm_line = [line for line in _log(fake_lib) if line.startswith("gemm")][0]
    # out^T [5, 3] = w^T [5, 4] @ x^T [4, 3]; both operands C layout: OP_N, ld = row stride; float16 in and
    # out, float32 compute (68), the default algorithm
    assert gemm_line == ("gemm transa=0 transb=0 m=5 n=3 k=4 lda=5 ldb=4 ldc=5 atype=2 btype=2 ctype=2 compute=68 "
                         f"algo=-1 stream={STREAM_A}")
    fake_lib.fake_cublas_reset()
    emb = np.ones((5, 4), np.float32)
    _matmul(gemm, np.ones((3, 4), np.float32), emb.T)  # F-ordered weight: OP_T, ld = its column stride
    assert [line for line in _log(fake_lib) if line.startswith("gemm")][0].startswith(
        "gemm transa=1 transb=0 m=5 n=3 k=4 lda=4 ldb=4 ldc=5 atype=0 btype=0 ctype=0 compute=68")


def test_stream_then_workspace_after_every_stream_change_and_only_then(gemm, fake_lib):
    x, w = np.ones((2, 3), np.float32), np.ones((3, 4), np.float32)
    _matmul(gemm, x, w, STREAM_A)
    _matmul(gemm, x, w, STREAM_A)
    _matmul(gemm, x, w, STREAM_B)
    steps = [line.split()[0] + (f" {line.split()[1]}" if line.startswith(("stream", "workspace")) else "")
             for line in _log(fake_lib)]
    assert steps == ["create", "math", f"stream {STREAM_A}", f"workspace {WORKSPACE}", "gemm", "gemm",
                     f"stream {STREAM_B}", f"workspace {WORKSPACE}", "gemm"]
    assert gemm.calls == 3


def test_the_fake_refuses_a_gemm_without_a_workspace(fake_lib):
    """The fake is strict where capture is: after cublasSetStream alone the handle has no workspace."""
    handle = ctypes.c_void_p()
    assert fake_lib.cublasCreate_v2(ctypes.byref(handle)) == 0
    assert fake_lib.cublasSetStream_v2(handle, ctypes.c_void_p(STREAM_A)) == 0
    one = np.ones(1, np.float32)
    args = [handle, 0, 0, 1, 1, 1, ctypes.c_void_p(one.ctypes.data), ctypes.c_void_p(one.ctypes.data), 0, 1,
            ctypes.c_void_p(one.ctypes.data), 0, 1, ctypes.c_void_p(one.ctypes.data), ctypes.c_void_p(one.ctypes.data),
            0, 1, 68, -1]
    assert fake_lib.cublasGemmEx(*args) == 1
    fake_lib.cublasDestroy_v2(handle)


def test_gemm_types_table():
    assert cublas.gemm_types(np.float16) == cublas.GemmTypes(cublas.CUDA_R_16F, cublas.CUBLAS_COMPUTE_32F,
                                                             np.dtype(np.float32))
    assert cublas.gemm_types("bfloat16").data_type == 14 and cublas.gemm_types("bfloat16").compute_type == 68
    assert cublas.gemm_types(np.float32) == cublas.GemmTypes(0, 68, np.dtype(np.float32))
    assert cublas.gemm_types(np.float64) == cublas.GemmTypes(1, 70, np.dtype(np.float64))
    with pytest.raises(ValueError, match="dtype int8 is not supported"):
        cublas.gemm_types(np.int8)


def test_layouts_cublas_cannot_read_are_refused_naming_the_operand():
    with pytest.raises(ValueError, match="x .* has neither contiguous rows nor contiguous columns"):
        cublas.plan_gemm((4, 4), (8, 2), (4, 3), (3, 1), (3, 1))
    with pytest.raises(ValueError, match="w has a negative stride"):
        cublas.plan_gemm((4, 4), (4, 1), (4, 3), (-3, 1), (3, 1))
    with pytest.raises(ValueError, match="do not chain"):
        cublas.plan_gemm((4, 4), (4, 1), (5, 3), (3, 1), (3, 1))
    with pytest.raises(ValueError, match="out must have contiguous rows"):
        cublas.plan_gemm((4, 4), (4, 1), (4, 3), (3, 1), (1, 4))


def test_a_failing_status_raises_with_its_name(gemm):
    plan = cublas.GemmPlan(0, 0, 4, 4, 4, 1, 4, 4)  # lda 1 < m 4: cuBLAS's INVALID_VALUE
    buf = np.zeros(16, np.float32)
    with pytest.raises(cublas.CublasError, match="cublasGemmEx returned CUBLAS_STATUS_INVALID_VALUE"):
        gemm.gemm_ptrs(np.float32, plan, buf.ctypes.data, buf.ctypes.data, buf.ctypes.data, STREAM_A)


def test_library_candidates_put_the_override_first(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_LIBCUBLAS", "/x/libcublas.so.99")
    found = cublas.find_libcublas()
    assert found[0] == "/x/libcublas.so.99" and not any("Lt" in c.rsplit("/", 1)[-1] for c in found)


def test_the_nvmath_route_makes_the_same_calls(fake_lib, monkeypatch):
    """NvmathApi against a stand-in for nvmath.bindings.cublas (ints for handles and pointers, as nvmath's
    cpdef functions take them) that forwards to the fake library: the same log, the same products."""
    ct = cublas.CtypesApi(fake_lib)
    nv = types.ModuleType("nvmath.bindings.cublas")
    for name in ("create", "destroy", "get_version", "set_math_mode", "set_stream", "set_workspace", "gemm_ex"):
        setattr(nv, name, getattr(ct, name))
    bindings = types.ModuleType("nvmath.bindings")
    bindings.cublas = nv
    monkeypatch.setitem(sys.modules, "nvmath", types.ModuleType("nvmath"))
    monkeypatch.setitem(sys.modules, "nvmath.bindings", bindings)
    monkeypatch.setitem(sys.modules, "nvmath.bindings.cublas", nv)
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((6, 10)).astype(np.float32), rng.standard_normal((10, 7)).astype(np.float32)
    logs, outs = [], []
    for api in (cublas.CtypesApi(fake_lib), cublas.NvmathApi()):
        fake_lib.fake_cublas_reset()
        g = cublas.CublasGemm(api, WORKSPACE, 1 << 20)
        outs.append(_matmul(g, x, w))
        g.close()
        logs.append(_log(fake_lib))
        assert g.route == api.route
    assert logs[0] == logs[1] and len(logs[0]) == 6
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], x @ w, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The binding inside the model: the Llama forward of get_backend("cuda") on the host emulation of the kernels,
# every linear through CublasGemm over the fake libcublas, against the float32 numpy model (the GPU suite's
# own check, gpu_helpers.check_model_logits_match_numpy): the real weights' layouts (fused qkv, gate_up, the
# tied lm_head's F-ordered view) all marshalled right.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def emulation_libs(tmp_path_factory):
    import importlib.util
    from concurrent.futures import ThreadPoolExecutor

    from pagedserve.cupy_kernels.cuda import modules as cuda_modules

    spec = importlib.util.spec_from_file_location("pagedserve_host_emulation_helpers_cublas",
                                                  Path(__file__).with_name("test_kernels_on_host.py"))
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    if host.GXX is None:
        pytest.skip("g++ not found (needed to run the kernels on the CPU)")
    workdir = tmp_path_factory.mktemp("host_emulation_cublas")
    mods = list(cuda_modules.MODULES.values())
    with ThreadPoolExecutor(max_workers=2) as pool:
        paths = list(pool.map(lambda m: host._build(m, workdir), mods))
    return host, {m.name: host.load(p) for m, p in zip(mods, paths)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_model_forward_with_every_linear_through_the_binding(emulation_libs, fake_lib, monkeypatch, name):
    import gpu_helpers
    from pagedserve.cupy_kernels.cuda import cublas_route, launch as cuda_launch, modules as cuda_modules

    host, libs = emulation_libs
    cp = host.fake_cupy(libs)
    cp.cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=0)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", "0")
    monkeypatch.setattr(cuda_modules, "_modules", {})
    monkeypatch.setattr(cuda_modules, "_functions", {})
    monkeypatch.setattr(cuda_launch, "_dummies", {})
    fake_lib.fake_cublas_reset()
    gemm = cublas.CublasGemm(fake_lib, WORKSPACE, 1 << 20)
    monkeypatch.setattr(cublas_route, "current_gemm", lambda: gemm)
    gpu_helpers.model_pair.cache_clear()
    try:
        gpu_helpers.check_model_logits_match_numpy(name)
    finally:
        gpu_helpers.model_pair.cache_clear()
    log = _log(fake_lib)
    assert gemm.calls > 20 and sum(line.startswith("gemm") for line in log) == gemm.calls
    tied = json.loads((Path(gpu_helpers.DATA) / name / "config.json").read_text())["tie_word_embeddings"]
    assert any(" transa=1 " in line for line in log if line.startswith("gemm")) == tied, \
        "a tied lm_head (the embedding's transposed view) is the one F-ordered weight"
