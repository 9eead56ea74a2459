"""cuBLAS GEMMs with our own handle, stream and workspace: a thin ctypes binding of libcublas (CtypesApi), or
nvmath-python's bindings (NvmathApi), the same calls either way; which one serves: cublas_route.py.

Why: CuPy refuses every cuBLAS call while a stream is capturing (cupy_backends/cuda/libs/cublas.pyx's
setStream raises NotImplementedError, `a @ b` and the low-level gemmEx alike; gpu-runs/2026-12-04/
cublas_capture_probe.json), although cuBLAS itself is capturable once the handle has a workspace of its
own (cublasSetWorkspace: without one cuBLAS would allocate inside the capture). Calling the library
directly never touches CuPy's guard. What it takes:

- a handle of ours (cublasCreate_v2), never CuPy's;
- the stream: CuPy's current stream pointer, set with cublasSetStream_v2 whenever it changes. cuBLAS
  resets the handle's workspace to its default pool on every cublasSetStream (the cuBLAS docs say so), so
  cublasSetWorkspace_v2 follows every cublasSetStream_v2;
- host pointer mode: alpha and beta live in host buffers of this object, read when the call is made
  (a graph captures their values, which never change: 1 and 0).

Row-major GEMM through column-major cuBLAS (`plan_gemm`). out[M, N] = x[M, K] @ w[K, N], every array
row-major. A row-major [r, c] buffer read column-major is its transpose, so cuBLAS is asked for
out^T[N, M] = w^T[N, K] @ x^T[K, M]: A = w, B = x, m = N, n = M, k = K. Each operand is passed as
CUBLAS_OP_N with ld = its row stride when its rows are contiguous (C layout), or as CUBLAS_OP_T with
ld = its column stride when its columns are (F layout: the tied lm_head, the embedding's transposed view);
any other layout is refused (the caller copies).

Types (`GEMM_TYPES`): float16 and bfloat16 storage multiply with CUBLAS_COMPUTE_32F (float32
accumulation, float32 alpha/beta, one rounding of the result: what CuPy's matmul does for float16),
float32 with CUBLAS_COMPUTE_32F (no TF32: the default math mode), float64 with CUBLAS_COMPUTE_64F.
Enum values: cuBLAS 12/13's cublas_api.h and library_types.h (checked against nvmath-python 1.0.1's
cycublas.pxd).

Tested on the CPU against a fake libcublas (tests/cupy_kernels/_fake_cublas.c, built with gcc) that
records each call and computes the GEMM on host memory; on a device, scripts/gpu_gemm_probe.py.
CuPy is imported inside functions only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

# library_types.h: cudaDataType
CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14
# cublas_api.h
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F = 68, 70
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_DEFAULT_MATH = 0
STATUS_NAMES = {
    0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR", 15: "CUBLAS_STATUS_NOT_SUPPORTED",
    16: "CUBLAS_STATUS_LICENSE_ERROR",
}
# 32 MiB: what NVIDIA recommends for Hopper (cuBLAS docs, cublasSetWorkspace); 4 MiB is enough elsewhere.
DEFAULT_WORKSPACE_BYTES = 32 << 20


@dataclass(frozen=True)
class GemmTypes:
    """How one storage dtype multiplies: cudaDataType of A, B and C, the compute type, alpha/beta's dtype."""

    data_type: int
    compute_type: int
    scale_dtype: np.dtype


GEMM_TYPES: dict[str, GemmTypes] = {
    "float16": GemmTypes(CUDA_R_16F, CUBLAS_COMPUTE_32F, np.dtype(np.float32)),
    "bfloat16": GemmTypes(CUDA_R_16BF, CUBLAS_COMPUTE_32F, np.dtype(np.float32)),
    "float32": GemmTypes(CUDA_R_32F, CUBLAS_COMPUTE_32F, np.dtype(np.float32)),
    "float64": GemmTypes(CUDA_R_64F, CUBLAS_COMPUTE_64F, np.dtype(np.float64)),
}


_TYPES_BY_DTYPE = {np.dtype(name): t for name, t in GEMM_TYPES.items() if name != "bfloat16"}


def gemm_types(dtype: Any) -> GemmTypes:
    """The row of GEMM_TYPES for a dtype, or its name (bfloat16 has no numpy dtype: ml_dtypes' is named so)."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    t = GEMM_TYPES.get(name)
    if t is None:
        raise ValueError(f"cublas gemm: dtype {name} is not supported (one of {', '.join(GEMM_TYPES)})")
    return t


class CublasError(RuntimeError):
    def __init__(self, call: str, status: int) -> None:
        super().__init__(f"{call} returned {STATUS_NAMES.get(status, status)}")
        self.status = status


@dataclass(frozen=True)
class GemmPlan:
    """cublasGemmEx's shape arguments for out[M, N] = x[M, K] @ w[K, N] (row-major), column-major."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int


def _operand(rows: int, cols: int, s0: int, s1: int, what: str) -> tuple[int, int]:
    """(op, ld) that make cuBLAS read the row-major [rows, cols] matrix with element strides (s0, s1) as its
    transpose [cols, rows]. A stride along an axis of length 1 is never used, so it does not decide."""
    if s0 < 0 or s1 < 0:
        raise ValueError(f"cublas gemm: {what} has a negative stride")
    if (s1 == 1 or cols == 1) and (rows == 1 or s0 >= max(cols, 1)):
        return CUBLAS_OP_N, max(s0 if rows > 1 else cols, 1)  # C layout: column-major [cols, rows], ld = row stride
    if (s0 == 1 or rows == 1) and (cols == 1 or s1 >= max(rows, 1)):
        return CUBLAS_OP_T, max(s1 if cols > 1 else rows, 1)  # F layout: column-major [rows, cols], transposed
    raise ValueError(f"cublas gemm: {what} [{rows}, {cols}] with element strides ({s0}, {s1}) has neither contiguous "
                     "rows nor contiguous columns")


def plan_gemm(x_shape, x_strides, w_shape, w_strides, out_strides) -> GemmPlan:
    """cuBLAS arguments for out = x @ w; shapes in elements, strides in elements (not bytes)."""
    if len(x_shape) != 2 or len(w_shape) != 2:
        raise ValueError(f"cublas gemm: x and w must be 2-D, got {tuple(x_shape)} and {tuple(w_shape)}")
    m_rows, k = x_shape
    if w_shape[0] != k:
        raise ValueError(f"cublas gemm: x {tuple(x_shape)} and w {tuple(w_shape)} do not chain")
    n_cols = w_shape[1]
    # cuBLAS's A = w (read as w^T [N, K]), B = x (read as x^T [K, M]).
    transa, lda = _operand(k, n_cols, w_strides[0], w_strides[1], "w")
    transb, ldb = _operand(m_rows, k, x_strides[0], x_strides[1], "x")
    if out_strides[1] != 1 and n_cols > 1:
        raise ValueError("cublas gemm: out must have contiguous rows")
    ldc = max(out_strides[0] if m_rows > 1 else n_cols, n_cols, 1)
    if m_rows > 1 and out_strides[0] < n_cols:
        raise ValueError("cublas gemm: out's rows overlap")
    return GemmPlan(transa, transb, n_cols, m_rows, k, lda, ldb, ldc)


# ---------------------------------------------------------------------------------------------
# The library
# ---------------------------------------------------------------------------------------------

_P = ctypes.c_void_p
_I = ctypes.c_int
_SIGNATURES = {
    "cublasCreate_v2": [ctypes.POINTER(_P)],
    "cublasDestroy_v2": [_P],
    "cublasGetVersion_v2": [_P, ctypes.POINTER(_I)],
    "cublasSetStream_v2": [_P, _P],
    "cublasSetWorkspace_v2": [_P, _P, ctypes.c_size_t],
    "cublasSetMathMode": [_P, _I],
    "cublasGemmEx": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I],
}


def _mapped_libcublas() -> list[str]:
    """libcublas files already mapped into this process (CuPy's own, once it has used cuBLAS)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcublas.so" in line and "Lt" not in line.split("/")[-1]}
    except OSError:
        return []
    return sorted(paths)


def find_libcublas() -> list[str]:
    """Candidates, best first: $PAGEDSERVE_LIBCUBLAS, a libcublas already loaded, the nvidia wheels,
    a CUDA toolkit, the loader's search path."""
    import importlib.util

    out = [os.environ.get("PAGEDSERVE_LIBCUBLAS", "")] + _mapped_libcublas()
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        out += sorted(glob.glob(os.path.join(root, "*", "lib", "libcublas.so.*")), reverse=True)
    for home in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            out += sorted(glob.glob(os.path.join(home, "lib64", "libcublas.so.*")), reverse=True)
    found = ctypes.util.find_library("cublas")
    out += [found] if found else []
    out += ["libcublas.so.13", "libcublas.so.12"]
    return [c for c in dict.fromkeys(out) if c and "Lt" not in os.path.basename(c)]


def load_library(path: str | None = None) -> ctypes.CDLL:
    """libcublas with the argument types of the calls used here; the first candidate that loads."""
    errors = []
    for candidate in [path] if path else find_libcublas():
        try:
            lib = ctypes.CDLL(candidate)
        except OSError as e:
            errors.append(f"{candidate}: {e}")
            continue
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        return lib
    raise OSError("libcublas not found: " + "; ".join(errors[-3:]) if errors else "libcublas not found")


class CtypesApi:
    """The calls CublasGemm makes, on a ctypes libcublas; a status other than success raises CublasError."""

    route = "ctypes"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    @staticmethod
    def _check(call: str, status: int) -> None:
        if status != 0:
            raise CublasError(call, status)

    def create(self) -> int:
        handle = _P()
        self._check("cublasCreate_v2", self.lib.cublasCreate_v2(ctypes.byref(handle)))
        return handle.value or 0

    def destroy(self, handle: int) -> None:
        self._check("cublasDestroy_v2", self.lib.cublasDestroy_v2(_P(handle)))

    def get_version(self, handle: int) -> int:
        v = _I()
        self._check("cublasGetVersion_v2", self.lib.cublasGetVersion_v2(_P(handle), ctypes.byref(v)))
        return v.value

    def set_math_mode(self, handle: int, mode: int) -> None:
        self._check("cublasSetMathMode", self.lib.cublasSetMathMode(_P(handle), mode))

    def set_stream(self, handle: int, stream: int) -> None:
        self._check("cublasSetStream_v2", self.lib.cublasSetStream_v2(_P(handle), _P(stream)))

    def set_workspace(self, handle: int, ptr: int, size: int) -> None:
        self._check("cublasSetWorkspace_v2", self.lib.cublasSetWorkspace_v2(_P(handle), _P(ptr), ctypes.c_size_t(size)))

    def gemm_ex(self, handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb, beta, c, ctype, ldc,
                compute_type, algo) -> None:
        self._check("cublasGemmEx", self.lib.cublasGemmEx(
            _P(handle), transa, transb, m, n, k, _P(alpha), _P(a), atype, lda, _P(b), btype, ldb, _P(beta), _P(c),
            ctype, ldc, compute_type, algo))


class NvmathApi:
    """The same calls through nvmath-python's bindings (nvmath.bindings.cublas: one function per cuBLAS call,
    handles and pointers as ints, errors raised as nvmath's cuBLASError)."""

    route = "nvmath"

    def __init__(self) -> None:
        from nvmath.bindings import cublas as nv  # optional: the probe says whether the image has it

        self.nv = nv

    def create(self) -> int:
        return int(self.nv.create())

    def destroy(self, handle: int) -> None:
        self.nv.destroy(handle)

    def get_version(self, handle: int) -> int:
        return int(self.nv.get_version(handle))

    def set_math_mode(self, handle: int, mode: int) -> None:
        self.nv.set_math_mode(handle, mode)

    def set_stream(self, handle: int, stream: int) -> None:
        self.nv.set_stream(handle, stream)

    def set_workspace(self, handle: int, ptr: int, size: int) -> None:
        self.nv.set_workspace(handle, ptr, size)

    def gemm_ex(self, *args) -> None:
        self.nv.gemm_ex(*args)


class CublasGemm:
    """One cuBLAS handle with its own workspace, following the caller's stream. `gemm_ptrs` is the whole
    call on raw pointers (what the fake-library test drives); `matmul` is the CuPy front."""

    def __init__(self, api: Any, workspace_ptr: int, workspace_bytes: int) -> None:
        if isinstance(api, ctypes.CDLL):
            api = CtypesApi(api)
        self.api = api
        self.handle = api.create()
        api.set_math_mode(self.handle, CUBLAS_DEFAULT_MATH)
        self.workspace_ptr, self.workspace_bytes = workspace_ptr, workspace_bytes
        self.stream_ptr: int | None = None
        # alpha = 1, beta = 0 in both scale dtypes; host memory that lives as long as the handle.
        self._scales = {np.dtype(d): (np.ones(1, d), np.zeros(1, d)) for d in (np.float32, np.float64)}
        self.calls = 0
        self._plans: dict[tuple, GemmPlan] = {}
        self.on_close: Any = None  # what else close() releases (make_cupy_gemm: the workspace)

    @property
    def route(self) -> str:
        return self.api.route

    def version(self) -> int:
        return self.api.get_version(self.handle)

    def set_stream(self, stream_ptr: int) -> None:
        """Follow `stream_ptr`; the workspace is set again after every stream change (cuBLAS resets it)."""
        if stream_ptr == self.stream_ptr:
            return
        self.api.set_stream(self.handle, stream_ptr)
        self.api.set_workspace(self.handle, self.workspace_ptr, self.workspace_bytes)
        self.stream_ptr = stream_ptr

    def gemm_ptrs(self, dtype: Any, plan: GemmPlan, x_ptr: int, w_ptr: int, out_ptr: int, stream_ptr: int) -> None:
        types = _TYPES_BY_DTYPE.get(dtype) or gemm_types(dtype)
        self.set_stream(stream_ptr)
        alpha, beta = self._scales[types.scale_dtype]
        t = types.data_type
        self.api.gemm_ex(self.handle, plan.transa, plan.transb, plan.m, plan.n, plan.k, alpha.ctypes.data, w_ptr, t,
                         plan.lda, x_ptr, t, plan.ldb, beta.ctypes.data, out_ptr, t, plan.ldc, types.compute_type,
                         CUBLAS_GEMM_DEFAULT)
        self.calls += 1

    def matmul(self, x, w, out=None):
        """x [M, K] @ w [K, N] -> out [M, N] (CuPy arrays, one dtype), on CuPy's current stream."""
        import cupy

        if x.dtype != w.dtype:
            raise ValueError(f"cublas gemm: x is {x.dtype} and w is {w.dtype}; one dtype expected")
        if out is None:
            out = cupy.empty((x.shape[0], w.shape[1]), dtype=x.dtype)
        key = (x.shape, x.strides, w.shape, w.strides, out.strides, x.dtype)
        plan = self._plans.get(key)
        if plan is None:  # a step's few shapes are planned once (the layers share them), not per call
            item = x.itemsize
            plan = plan_gemm(x.shape, [s // item for s in x.strides], w.shape, [s // item for s in w.strides],
                             [s // item for s in out.strides])
            if len(self._plans) > 4096:
                self._plans.clear()
            self._plans[key] = plan
        if x.shape[0] and w.shape[1]:
            if not x.shape[1]:
                out.fill(0)
            else:
                self.gemm_ptrs(x.dtype, plan, x.data.ptr, w.data.ptr, out.data.ptr,
                               cupy.cuda.get_current_stream().ptr)
        return out

    def close(self) -> None:
        if self.handle:
            self.api.destroy(self.handle)
            self.handle = 0
            if self.on_close is not None:
                self.on_close()


def make_cupy_gemm(route: str = "ctypes", workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> CublasGemm:
    """A CublasGemm on the current device through `route` ("ctypes" or "nvmath"). Its workspace is a plain
    cudaMalloc, outside CuPy's memory pools (a graph's private pool or a warm-up's throw-away pool must never
    own it), freed by close()."""
    import cupy

    cupy.cuda.device.get_cublas_handle()  # CuPy loads its libcublas: ours is then the same file (/proc/self/maps)
    api = CtypesApi(load_library()) if route == "ctypes" else NvmathApi() if route == "nvmath" else None
    if api is None:
        raise ValueError(f"cublas route {route!r}: expected 'ctypes' or 'nvmath'")
    ptr = cupy.cuda.runtime.malloc(workspace_bytes)
    try:
        g = CublasGemm(api, ptr, workspace_bytes)
    except BaseException:
        cupy.cuda.runtime.free(ptr)
        raise
    g.on_close = lambda: cupy.cuda.runtime.free(ptr)
    return g
