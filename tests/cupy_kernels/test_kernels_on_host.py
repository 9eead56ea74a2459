"""The real CUDA kernels and cuda_ops' launch code, run on the CPU (no GPU needed).

Each kernel family file is compiled unchanged by g++ after tests/cupy_kernels/_host_emulation.h, which
runs every CUDA thread of a CTA as a fiber with real barriers and warp shuffles. A stand-in `cupy`
module (numpy arrays whose type claims to be CuPy's) is installed for the duration of a test, so
cuda_ops and the CUDA op table run unmodified: RawModule receives the exact source string and
options, get_function checks that the name is one of the module's instantiations, and each launch
checks its argument count and byte sizes against the kernel's parameter list.

What this cannot show: speed, behaviour of the real NVRTC/ptxas, PTX asm (cvt, cp.async: stood in by
the harness), or races the GPU's memory model would allow. Those are for the GPU tests.
Skipped when g++ is absent.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import gpu_helpers
from gpu_helpers import build_cache, cuda
from prefill_checks import PREFILL_SPECS, as_float32, check_prefill, prefill_case
from pagedserve.cupy_kernels.cuda import attention as cuda_attention, launch as cuda_launch, modules as cuda_modules
from pagedserve.cupy_kernels.cuda import cublas_route, ops as cuda_ops
from pagedserve.cupy_kernels.reference import paged_attention as pa

GXX = shutil.which("g++")
# The preludes the harness stands in for (PTX asm); the others (kv_types.cuh: plain C++) are compiled as they are.
EMULATED_PRELUDES = {"tensor_core.cuh"}
HARNESS = Path(__file__).with_name("_host_emulation.h")
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not found (needed to run the kernels on the CPU)")


class CaptureViolation(RuntimeError):
    """What a stream capture on the device refuses, or would record wrong: raised by the stand-in inside a capture."""


# While StrictCapturer captures: host syncs, device-to-host copies, host reads of a device value, CuPy pool
# allocations and CuPy array expressions (ufuncs, astype, take, fancy indexing, a copy into a view) raise
# CaptureViolation naming what and where; with strict=False (the fake before issue 59's last part) the last two are
# only counted.
CAPTURE = {"on": False, "strict": False, "allocations": 0, "expressions": 0, "what": []}


def _where(depth: int = 3) -> str:
    """The innermost `depth` callers outside this file (the project's lines that did it), innermost first."""
    frame, found = sys._getframe(1), []
    while frame is not None and len(found) < depth:
        if frame.f_code.co_filename != __file__:
            found.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(found) or "?"


def _capture_event(kind: str, what: str, fatal: bool) -> None:
    if not CAPTURE["on"]:
        return
    what = f"{what} at {_where()}"
    CAPTURE["what"].append(f"{kind}: {what}")
    if kind in ("allocations", "expressions"):
        CAPTURE[kind] += 1
    if fatal or CAPTURE["strict"]:
        raise CaptureViolation(f"{kind} inside a stream capture: {what}")


class EmulatedArray(np.ndarray):
    """A numpy array that cuda_ops takes for a CuPy one (is_cupy_array looks at the type's module)."""

    __module__ = "cupy_host_emulation"

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    def get(self):
        _capture_event("device-to-host copy", "ndarray.get()", fatal=True)
        return np.array(self.view(np.ndarray))

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        out = super().astype(dtype, order=order, casting=casting, subok=subok, copy=copy)
        if out is not self:  # CuPy: an elementwise kernel into a new pool allocation
            _capture_event("expressions", f"astype({np.dtype(dtype).name})", fatal=False)
        return out

    def copy(self, order="C"):
        _capture_event("expressions", "ndarray.copy()", fatal=False)
        return super().copy(order=order)

    def reshape(self, *shape, **kwargs):
        out = super().reshape(*shape, **kwargs)
        if CAPTURE["on"] and out.size and not np.shares_memory(out, self):  # CuPy copies a layout it cannot view
            _capture_event("allocations", "reshape (a copy)", fatal=False)
        return out

    def __setitem__(self, key, value):
        if isinstance(value, np.ndarray):  # CuPy: a copy kernel (elementwise) into the view
            _capture_event("expressions", "a copy into a view (a[...] = b)", fatal=False)
        super().__setitem__(key, value)

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        _capture_event("expressions", f"{ufunc.__name__}.{method}", fatal=False)
        plain = [x.view(np.ndarray) if isinstance(x, EmulatedArray) else x for x in inputs]
        if out is not None:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, EmulatedArray) else o for o in out)
        result = getattr(ufunc, method)(*plain, **kwargs)
        if out is not None or method == "at":
            return None if method == "at" else (out[0] if len(out) == 1 else out)

        def wrap(r):  # in a capture a reduction stays on the device (CuPy's 0-d array): reading it is a host read
            if type(r) is np.ndarray or (CAPTURE["on"] and isinstance(r, np.generic)):
                return np.asarray(r).view(EmulatedArray)
            return r
        return tuple(map(wrap, result)) if isinstance(result, tuple) else wrap(result)

    def __getitem__(self, key):
        if isinstance(key, (np.ndarray, list)) or (isinstance(key, tuple) and any(
                isinstance(k, (np.ndarray, list)) for k in key)):  # CuPy: a gather kernel into a new array
            _capture_event("expressions", "fancy indexing (a gather)", fatal=False)
        out = super().__getitem__(key)
        if CAPTURE["on"] and not isinstance(out, np.ndarray):  # one element: CuPy's 0-d array, read on the host
            self._host_value(f"element [{key}]")
        return out

    def _host_value(self, how):
        _capture_event("host read of a device value", how, fatal=True)

    def __bool__(self):
        self._host_value("bool()")
        return super().__bool__()

    def __int__(self):
        self._host_value("int()")
        return super().__int__()

    def __float__(self):
        self._host_value("float()")
        return super().__float__()

    def __index__(self):
        self._host_value("operator.index()")
        return super().__index__()

    def item(self, *args):
        self._host_value("item()")
        return super().item(*args)

    def tolist(self):
        self._host_value("tolist()")
        return super().tolist()


def _dev(a, dtype=None) -> EmulatedArray:
    return np.array(np.asarray(a), dtype=dtype).view(EmulatedArray)


def _garbage(shape, dtype) -> EmulatedArray:
    a = np.empty(shape, dtype=dtype)
    a.view(np.uint8)[...] = 0xFF  # NaN for floats, -1 for ints: unwritten outputs cannot pass
    return a.view(EmulatedArray)


# What the stand-in device allows a CTA once opted in (sm_90's cudaDevAttrMaxSharedMemoryPerBlockOptin).
EMULATED_OPTIN_LIMIT = 232448


class EmulatedKernel:
    """A RawModule function: launches run the kernel on the emulation with `shared_mem` bytes of dynamic shared
    memory, which (as on the GPU) may pass 48 KB only after max_dynamic_shared_size_bytes was raised."""

    def __init__(self, lib, index: int, name: str):
        self.fn = getattr(lib, f"ps_launch_{index}")
        self.fn.restype = ctypes.c_int
        self.name = name
        self.max_dynamic_shared_size_bytes = cuda_modules.DEFAULT_SHARED_LIMIT

    def __call__(self, grid, block, args, shared_mem=0):
        assert 0 <= shared_mem <= self.max_dynamic_shared_size_bytes, \
            f"{self.name}: {shared_mem} bytes of dynamic shared memory, {self.max_dynamic_shared_size_bytes} allowed"
        dims = [int(v) for v in grid] + [1] * (3 - len(grid)) + [int(v) for v in block] + [1] * (3 - len(block))
        buffers, sizes = [], []
        for a in args:
            if isinstance(a, EmulatedArray):
                buffers.append(ctypes.c_void_p(a.__array_interface__["data"][0]))
                sizes.append(8)
            elif isinstance(a, np.generic):
                raw = a.tobytes()
                buf = ctypes.create_string_buffer(b"\xab" * 8, 8)  # wrong-width reads see garbage
                ctypes.memmove(buf, raw, len(raw))
                buffers.append(buf)
                sizes.append(len(raw))
            else:
                raise TypeError(f"{self.name}: argument of type {type(a).__name__}; pass numpy scalars or arrays")
        argv = (ctypes.c_void_p * len(args))(*[ctypes.addressof(b) for b in buffers])
        rc = self.fn((ctypes.c_uint * 6)(*dims), argv, len(args), (ctypes.c_int * len(args))(*sizes),
                     ctypes.c_int(int(shared_mem)))
        assert rc == 0, f"{self.name}: launch rejected (see stderr)"


class EmulatedModule:
    def __init__(self, libs, code, options=(), name_expressions=()):
        matches = [m for m in cuda_ops.MODULES.values()
                   if m.source() == code and m.name_expressions == tuple(name_expressions)]
        assert len(matches) == 1, "RawModule got a source and names that are not one of cuda_ops.MODULES"
        self.spec = matches[0]
        assert tuple(options) == cuda_ops.NVRTC_OPTIONS
        assert tuple(name_expressions) == self.spec.name_expressions
        self.lib = libs[self.spec.name]

    def get_function(self, name):
        assert name in self.spec.name_expressions, f"{name} is not instantiated in module {self.spec.name}"
        return EmulatedKernel(self.lib, self.spec.name_expressions.index(name), name)


def fake_cupy(libs) -> types.ModuleType:
    cp = types.ModuleType("cupy")
    cp.ndarray = EmulatedArray
    for name in ("float16", "float32", "float64", "int32", "int64", "uint8", "uint64"):
        setattr(cp, name, getattr(np, name))
    def alloc(what, make):
        def f(*args, **kwargs):
            _capture_event("allocations", what, fatal=False)
            return make(*args, **kwargs)
        return f

    def asarray(a, dtype=None):
        if isinstance(a, EmulatedArray) and dtype in (None, a.dtype):
            return a
        if not isinstance(a, EmulatedArray):
            _capture_event("host-to-device copy", "cupy.asarray(host array)", fatal=True)
        _capture_event("allocations", "cupy.asarray", fatal=False)
        return _dev(a, dtype)

    cp.empty = alloc("cupy.empty", lambda shape, dtype=np.float64: _garbage(shape, dtype))
    cp.zeros = alloc("cupy.zeros", lambda shape, dtype=np.float64: np.zeros(shape, dtype).view(EmulatedArray))
    cp.ones = alloc("cupy.ones", lambda shape, dtype=np.float64: np.ones(shape, dtype).view(EmulatedArray))
    cp.asarray = asarray
    def ascontiguousarray(a, dtype=None):
        out = np.ascontiguousarray(a, dtype=dtype)
        if not np.shares_memory(out, a):  # CuPy returns the array itself when it already is
            _capture_event("allocations", "cupy.ascontiguousarray (a copy)", fatal=False)
        return out.view(EmulatedArray)

    def take(a, ids, axis=None, out=None):
        _capture_event("expressions", "cupy.take", fatal=False)
        if out is None:
            _capture_event("allocations", "cupy.take", fatal=False)
            return np.take(a.view(np.ndarray), np.asarray(ids), axis=axis).view(EmulatedArray)
        np.take(a.view(np.ndarray), np.asarray(ids), axis=axis, out=out.view(np.ndarray))
        return out

    def elementwise(name, f):
        def g(x):
            _capture_event("expressions", f"cupy.{name}", fatal=False)
            return f(np.asarray(x)).view(EmulatedArray)
        return g

    cp.ascontiguousarray = ascontiguousarray
    cp.take = take
    cp.cos, cp.sin = elementwise("cos", np.cos), elementwise("sin", np.sin)
    cp.matmul = lambda a, b, out=None: np.matmul(a, b, out=out)  # a ufunc: counted by __array_ufunc__
    optin = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin
    runtime = types.SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1,
                                    cudaDevAttrMaxSharedMemoryPerBlockOptin=optin,
                                    deviceGetAttribute=lambda attr, dev: {optin: EMULATED_OPTIN_LIMIT}[attr])
    cp.cuda = types.SimpleNamespace(runtime=runtime)
    cp.RawKernel = EmulatedKernel
    cp.RawModule = lambda code, options=(), name_expressions=(): EmulatedModule(libs, code, options, name_expressions)
    return cp


def _build(module: cuda_ops.KernelModule, workdir: Path) -> Path:
    common = (cuda_ops.KERNEL_DIR / "common.cu").read_text()
    source = module.source()
    assert common in source
    source = source.replace(common, f'#include "{HARNESS}"\n')
    for prelude in set(module.preludes) & EMULATED_PRELUDES:  # the harness stands in for these (the mma model)
        text = (cuda_ops.KERNEL_DIR / prelude).read_text()
        assert text in source
        source = source.replace(text, "")
    lines = [source, ""]
    for i, expr in enumerate(module.name_expressions):
        lines.append(f'extern "C" int ps_launch_{i}(const unsigned* dims, void** args, int nargs, const int* sizes, '
                     f"int shared) {{ return ps_launch(&{expr}, dims, args, nargs, sizes, shared); }}")
    src = workdir / f"{module.name}.cpp"
    src.write_text("\n".join(lines) + "\n")
    lib = workdir / f"lib{module.name}.so"
    # -fno-gnu-unique: a template kernel's static __shared__ arrays are otherwise STB_GNU_UNIQUE symbols, which the
    # dynamic linker unifies across every loaded library, RTLD_LOCAL or not: a second build of the same kernels (a
    # mutant) would run on the first library's arrays, and its own (the ones registered for poisoning) go unused.
    flags = ["-std=c++17", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-U_FORTIFY_SOURCE", "-fno-gnu-unique"]
    proc = subprocess.run([GXX, *flags, "-o", str(lib), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"g++ failed for {module.name}:\n{proc.stderr[-6000:]}"
    return lib


def _static_shared(lib: Path) -> list[tuple[int, int]]:
    """(offset, bytes) of every function-local static in the library: the kernels' static __shared__ arrays (the
    harness has no function-local statics; guard variables, _ZGV..., are not among them)."""
    nm = shutil.which("nm")
    assert nm, "nm (binutils) not found: the host emulation needs it to poison static shared memory per CTA"
    out = subprocess.run([nm, "-S", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[3].startswith("_ZZ") and parts[2] in "bBuVdD" and int(parts[1], 16):
            found.append((int(parts[0], 16), int(parts[1], 16)))
    return found


def load(lib: Path) -> ctypes.CDLL:
    """The emulated module, its static shared memory registered for poisoning before every CTA."""
    handle = ctypes.CDLL(str(lib))
    for offset, size in _static_shared(lib):
        handle.ps_add_static_shared(ctypes.c_ulong(offset), ctypes.c_ulong(size))
    return handle


class _Libs(dict):
    """The emulated modules by name: a module of another KV element type than its query's (the kv_cache_dtype
    modules, modules._paged_attention_module's kv) is built when a test first loads it."""

    def __init__(self, workdir: Path):
        super().__init__()
        self.workdir = workdir

    def __missing__(self, name: str) -> ctypes.CDLL:
        self[name] = load(_build(cuda_ops.MODULES[name], self.workdir))
        return self[name]


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("host_emulation")
    mods = [m for m in cuda_ops.MODULES.values() if "_kv_" not in m.name]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        paths = list(pool.map(lambda m: _build(m, workdir), mods))
    built = _Libs(workdir)
    built.update({m.name: load(p) for m, p in zip(mods, paths)})
    return built


@pytest.fixture
def emulated(libs, monkeypatch):
    """Install the stand-in cupy (and fresh kernel caches) for one test."""
    cp = fake_cupy(libs)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    # linear's GEMM: the route a device takes when its cuBLAS captures (no CuPy `x @ w` inside a forward)
    monkeypatch.setitem(cublas_route._chosen, (id(cp), 0), ("emulated", EmulatedGemm()))
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", "0")  # EmulatedModule stands in for RawModule
    monkeypatch.setattr(cuda_modules, "_modules", {})
    monkeypatch.setattr(cuda_modules, "_functions", {})
    monkeypatch.setattr(cuda_launch, "_dummies", {})
    gpu_helpers.model_pair.cache_clear()  # a model holds arrays of the cupy it was built under
    yield
    gpu_helpers.model_pair.cache_clear()


# ---------------------------------------------------------------------------------------------
# Paged attention (sizes cut down: every CUDA thread is a fiber here)
# ---------------------------------------------------------------------------------------------

MIXED = [(1, 1), (7, 7), (40, 40), (100, 33), (1100, 1), (513, 1), (512, 1), (700, 45), (17, 1), (530, 3)]
DECODES = [(1, 1), (17, 1), (512, 1), (513, 1), (1100, 1)]


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128)])
def test_paged_attention_on_host(emulated, block_size, head_dim, group):
    rng = np.random.default_rng(group + block_size)
    gpu_helpers.check_paged_attention(rng, (("mixed", MIXED), ("decode", DECODES)), 2, head_dim, block_size, group,
                                      "host")


def test_batch_invariance_on_host(emulated):
    specs = {"A": (1300, 1), "B": (200, 40), "C": (60, 1), "D": (90, 90)}
    gpu_helpers.check_batch_invariance(4, specs, (["C", "A", "B", "D"], ["A", "C"], ["D", "B"]), 64)


def test_never_written_slots_are_never_read_on_host(emulated):
    gpu_helpers.check_never_written_slots_are_never_read([(600, 1), (37, 37)], 1, 3, 64)


# Sliding window: decodes long enough to be split into partitions (the walk then starts at the partition of
# the window's oldest key), chunks deep in a context, short prompts; windows under a tile, not a multiple of
# 16, over a partition (512), and past every context.
WINDOW_SPECS = [(1100, 1), (1500, 1), (513, 1), (700, 45), (100, 33), (40, 40), (17, 1), (530, 3)]


def _check_sliding_window(rng, specs, num_kv, num_heads, dim, block_size, window):
    """Against the numpy reference with the same window; host and device metadata the same bits; NaN in every block
    wholly older than a sequence's window (blocks the KV manager may have given away): the same bits again."""
    k, v, qsl, lens, tables = build_cache(rng, specs, num_kv, dim, block_size)
    query = rng.standard_normal((int(qsl[-1]), num_heads, dim)).astype(np.float16)
    scale = dim ** -0.5
    ref = pa.paged_attention(query.astype(np.float32), k.astype(np.float32), v.astype(np.float32), qsl, lens,
                             np.where(tables == gpu_helpers.PAD_BLOCK, 0, tables), scale, sliding_window=window)
    got = cuda.paged_attention(_dev(query), _dev(k), _dev(v), qsl, lens, tables, scale, sliding_window=window).get()
    gpu_helpers.check_attention(got, ref, f"host/sliding_window/d{dim}/{window}")
    device = cuda.paged_attention(_dev(query), _dev(k), _dev(v), _dev(qsl), _dev(lens), _dev(tables), scale,
                                  sliding_window=window).get()
    np.testing.assert_array_equal(device, got)
    old = 0
    for i, length in enumerate(lens):
        oldest = max(0, int(length) - int(qsl[i + 1] - qsl[i]) - window + 1)
        for b in range(oldest // block_size):
            k[tables[i, b]] = v[tables[i, b]] = np.nan
            old += 1
    poisoned = cuda.paged_attention(_dev(query), _dev(k), _dev(v), qsl, lens, tables, scale,
                                    sliding_window=window).get()
    np.testing.assert_array_equal(poisoned, got)
    return old


@pytest.mark.parametrize("window", [1, 5, 16, 37, 600, 2000])
def test_sliding_window_attention_on_host(emulated, window):
    old = _check_sliding_window(np.random.default_rng(window), WINDOW_SPECS, 2, 6, 64, 16, window)
    assert old or window == 2000


# Head dim 256 (Gemma 3: 4 query heads, 1 kv head in the 270M model; sliding window 512). Cut down: a 1,100-token
# decode (three partitions and the reduce), a 600-token one (two), a 45-token chunk deep in a context and a short
# prompt (BLOCK_M 16: 52,288 bytes of dynamic shared memory, past 48 KB), a plain decode.
D256_SPECS = [(1100, 1), (600, 1), (300, 45), (20, 20), (17, 1)]


@pytest.mark.parametrize("group,block_size", [(4, 16), (24, 32)])
def test_paged_attention_head_dim_256_on_host(emulated, monkeypatch, group, block_size):
    """Against numpy, host and device metadata the same bits. Group 4: decodes at BLOCK_M 4, the chunks at 16 (opted
    in past 48 KB); group 24: BLOCK_M 32 (70,784 bytes), its last 8 rows padding. The launches pass
    attention_shared_bytes, and the emulation aborts unless that is the kernel's own layout size."""
    launches = []
    real_kernel = cuda_attention._kernel
    monkeypatch.setattr(cuda_attention, "_kernel", lambda module, name: launches.append(real_kernel(module, name))
                        or launches[-1])
    rng = np.random.default_rng(group)
    gpu_helpers.check_paged_attention(rng, (("mixed", D256_SPECS),), 1, 256, block_size, group, "host")
    attend = {k.name: k.max_dynamic_shared_size_bytes for k in launches if k.name.startswith("paged_attention_kernel")}
    block_m = 16 if group == 4 else 32
    assert attend[cuda_modules.attention_kernel_name(256, block_size, block_m)] == \
        cuda_modules.attention_shared_bytes(256, block_m) > cuda_modules.DEFAULT_SHARED_LIMIT
    assert any(k.name.startswith("paged_attention_reduce_kernel<256") for k in launches)


@pytest.mark.parametrize("window", [37, 512])
def test_sliding_window_head_dim_256_on_host(emulated, window):
    assert _check_sliding_window(np.random.default_rng(window), D256_SPECS, 1, 4, 256, 16, window)


def test_shared_memory_opt_in(monkeypatch):
    """_kernel opts a function in to its dynamic shared memory past 48 KB only (KernelModule.large_shared), through
    RawKernel's attribute or, for the kernel cache's cupy.cuda.function.Function, cuFuncSetAttribute; a device
    that allows less is refused with a ValueError."""
    calls = []
    driver = types.SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8,
                                   funcSetAttribute=lambda ptr, attr, value: calls.append((ptr, attr, value)))
    limit = {"optin": 232448}
    runtime = types.SimpleNamespace(getDevice=lambda: 0, cudaDevAttrMaxSharedMemoryPerBlockOptin=97,
                                    deviceGetAttribute=lambda attr, dev: limit["optin"] if attr == 97 else -1)

    class RawKernel:
        max_dynamic_shared_size_bytes = 0

    class Function:
        ptr = 1234

    class Module:
        def __init__(self, make):
            self.make = make

        def get_function(self, name):
            return self.make()

    cp = types.ModuleType("cupy")
    cp.RawKernel = RawKernel
    cp.cuda = types.SimpleNamespace(runtime=runtime, driver=driver)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(cuda_modules, "_functions", {})
    big, small = cuda_modules.attention_kernel_name(256, 16, 16), cuda_modules.attention_kernel_name(128, 16, 32)
    loaded = {(m, 0): Module(RawKernel) for m in cuda_modules.FAMILIES["paged_attention"]}
    monkeypatch.setattr(cuda_modules, "_modules", loaded)
    assert cuda_modules._kernel("paged_attention", big).max_dynamic_shared_size_bytes == 52288
    assert cuda_modules._kernel("paged_attention", small).max_dynamic_shared_size_bytes == 0
    monkeypatch.setattr(cuda_modules, "_functions", {})
    monkeypatch.setattr(cuda_modules, "_modules", {k: Module(Function) for k in loaded})
    cuda_modules._kernel("paged_attention", big)
    cuda_modules._kernel("paged_attention", small)
    assert calls == [(1234, 8, 52288)]
    monkeypatch.setattr(cuda_modules, "_functions", {})
    limit["optin"] = 50000
    with pytest.raises(ValueError, match="needs 52288 bytes of shared memory a CTA; device 0 allows 50000"):
        cuda_modules._kernel("paged_attention", big)
    large = {n: b for m in cuda_modules.FAMILIES["paged_attention"] for n, b in cuda_modules.MODULES[m].large_shared}
    m = cuda_modules
    shapes = itertools.product(m.ATTN_TYPES, m.ATTN_HEAD_DIMS, m.ATTN_BLOCK_SIZES, m.ATTN_BLOCK_MS)
    for kind, dim, bs, block_m in shapes:
        name, dynamic = m.attention_kernel_name(dim, bs, block_m, kind), m.attention_shared_bytes(dim, block_m)
        opted_in = dynamic + m.attention_static_shared_bytes(block_m) > m.DEFAULT_SHARED_LIMIT
        assert large.get(name, dynamic if opted_in else None) == (dynamic if opted_in else None), name
        assert opted_in == (dim == 256 and block_m >= 16), name


def test_sliding_window_batch_invariance_on_host(emulated):
    """Each sequence alone and in batches (decode-only and mixed launches, other tile shapes): the same bits."""
    rng = np.random.default_rng(8)
    k, v, qsl, lens, tables = build_cache(rng, WINDOW_SPECS, 2, 64, 16)
    query = rng.standard_normal((int(qsl[-1]), 8, 64)).astype(np.float16)
    whole = cuda.paged_attention(_dev(query), _dev(k), _dev(v), qsl, lens, tables, 0.125, sliding_window=37).get()
    for i in range(len(lens)):
        a, b = int(qsl[i]), int(qsl[i + 1])
        alone = cuda.paged_attention(_dev(query[a:b]), _dev(k), _dev(v), np.array([0, b - a], np.int32),
                                     lens[i:i + 1], tables[i:i + 1], 0.125, sliding_window=37).get()
        np.testing.assert_array_equal(alone, whole[a:b])


def test_a_prompt_chunked_or_not_is_the_same_bits_on_host(emulated):
    """A 200-token prompt in one launch and in chunks of 1, 30 and 169 tokens, window 45: each CTA's walk starts
    at the tile of its own first row, which must never change a row's bits."""
    rng = np.random.default_rng(9)
    k, v, qsl, lens, tables = build_cache(rng, [(200, 200)], 1, 64, 16)
    query = rng.standard_normal((200, 4, 64)).astype(np.float16)
    whole = cuda.paged_attention(_dev(query), _dev(k), _dev(v), qsl, lens, tables, 0.125, sliding_window=45).get()
    for a, b in ((0, 1), (1, 31), (31, 200)):
        part = cuda.paged_attention(_dev(query[a:b]), _dev(k), _dev(v), np.array([0, b - a], np.int32),
                                    np.array([b], np.int32), tables, 0.125, sliding_window=45).get()
        np.testing.assert_array_equal(part, whole[a:b])


# ---------------------------------------------------------------------------------------------
# The GPU suite's checks for the other kernels (tests/gpu_helpers.py), unchanged, on the emulation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_reshape_and_cache_on_host(emulated, dtype):
    gpu_helpers.check_reshape_and_cache(dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_rotary_and_cache_on_host(emulated, dtype):
    gpu_helpers.check_rotary_and_cache(dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_kv_dtype_cache_write_on_host(emulated, kv_cache_dtype):
    gpu_helpers.check_kv_dtype_cache_write(kv_cache_dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("group,window", [(1, None), (4, 300)])
def test_kv_dtype_attention_on_host(emulated, kv_cache_dtype, group, window):
    gpu_helpers.check_kv_dtype_attention(np.random.default_rng(group), kv_cache_dtype, (("mixed", MIXED),), 2, 64,
                                         16, group, window)


def test_kv_dtype_refusals_on_host(emulated):
    gpu_helpers.check_kv_dtype_refusals()


def test_copy_blocks_on_host(emulated):
    gpu_helpers.check_copy_blocks_all_layers_one_launch()


@pytest.mark.parametrize("reverse", [False, True])
def test_copy_blocks_source_freed_and_reused_as_destination_on_host(emulated, libs, reverse):
    """CTAs run first to last and last to first: a direct one-launch copy gets one of the two wrong."""
    libs["cache_ops"].ps_set_reverse_grid(int(reverse))
    try:
        gpu_helpers.check_copy_blocks_source_freed_and_reused_as_destination()
    finally:
        libs["cache_ops"].ps_set_reverse_grid(0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("hidden", [64, 576, 5000])
def test_add_rms_norm_on_host(emulated, hidden, dtype):
    gpu_helpers.check_add_rms_norm(hidden, dtype)


def test_apply_rotary_on_host(emulated):
    gpu_helpers.check_apply_rotary()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_silu_and_mul_on_host(emulated, dtype):
    gpu_helpers.check_silu_and_mul(dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_argmax_rows_on_host(emulated, dtype):
    gpu_helpers.check_argmax_rows(dtype)


def test_ops_write_into_out_on_host(emulated):
    gpu_helpers.check_ops_write_into_out()


def test_embedding_and_validation_on_host(emulated):
    gpu_helpers.check_ops_return_device_arrays()
    gpu_helpers.check_paged_attention_rejects_unsupported_shapes()
    gpu_helpers.check_paged_attention_strided_query_view()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-gemma3", "tiny-llama32-bias"])
def test_model_forward_on_host(emulated, name):
    """The forward with get_backend("cuda") (float16, every op through cuda_ops) vs numpy float32. tiny-gemma3: head
    dim 256, a sliding layer (window 8) and a full one; its GELU-tanh gate is CuPy array code (models/layers.py), here
    numpy's functions on the stand-in arrays."""
    if name == "tiny-gemma3":
        sys.modules["cupy"].__getattr__ = lambda attr: getattr(np, attr)
    gpu_helpers.check_model_logits_match_numpy(name)


# ---------------------------------------------------------------------------------------------
# The GPU runtime path (device metadata, CUDA graph replays, on-device sampling) on the emulation.
# Graph capture itself needs a GPU: a fake capturer records the forward and "replays" it by calling
# it, so a replay reads the static buffers as they are at launch, as a real graph does.
# ---------------------------------------------------------------------------------------------


class EmulatedGemm:
    """The GEMM route (cublas_route: our own cuBLAS handle, which a capture records) on the stand-in: the product
    into `out` (a new pool allocation without one), as numpy's float16 matmul rounds it; no CuPy expression."""

    def matmul(self, x, w, out=None):
        if x.dtype != w.dtype:
            raise ValueError(f"cublas gemm: x is {x.dtype} and w is {w.dtype}; one dtype expected")
        if out is None:
            out = sys.modules["cupy"].empty((x.shape[0], w.shape[1]), dtype=x.dtype)
        np.matmul(x.view(np.ndarray), w.view(np.ndarray), out=out.view(np.ndarray))
        return out

    def close(self):
        pass


class RecordingCapturer:
    def __init__(self):
        self.events = []

    def warmup(self, fn):
        self.events.append("warmup")
        fn()

    def capture(self, fn):
        self.events.append("capture")
        return fn

    def reserve(self):
        self.events.append("reserve")

    def upload(self, copies):
        for dst, src in copies:
            dst[...] = src

    def launch(self, graph):
        self.events.append("launch")
        graph()

    def synchronize(self):
        pass

    def pool_bytes(self):
        return 0

    def release(self):
        self.events.append("release")


class StrictCapturer(RecordingCapturer):
    """Runs the real forward inside a "capture" that fails as a device's would: a host sync, a device-to-host copy,
    a host-to-device copy from pageable memory, a host read of a device value, a CuPy pool allocation (the graph's
    private pool would serve it) or a CuPy array expression (~40 us of Python each) raises CaptureViolation, naming
    what and the project line that did it. strict=False is the fake before that: allocations and expressions are only
    counted per capture (`counts`)."""

    def __init__(self, strict: bool = True):
        super().__init__()
        self.strict = strict
        self.counts = []

    def capture(self, fn):
        self.events.append("capture")
        CAPTURE.update(on=True, strict=self.strict, allocations=0, expressions=0, what=[])
        try:
            fn()
        finally:
            self.counts.append({k: CAPTURE[k] for k in ("allocations", "expressions", "what")})
            CAPTURE.update(on=False, strict=False, what=[])
        return fn

    def synchronize(self):
        _capture_event("host sync", "synchronize()", fatal=True)


@pytest.mark.slow
def test_decode_graph_replays_on_host(emulated):
    """Padded replays against eager steps through the real kernels, with context buckets of one and two
    partitions (max_model_len 1024; the 700- and 530-token decodes take the two-partition graphs);
    exact sizes bit for bit, KV included."""
    capturer = RecordingCapturer()
    gpu_helpers.check_decode_graph_replays("tiny-llama", capturer)
    assert capturer.events.count("capture") == 4 * 2 and "release" not in capturer.events
    assert capturer.events.count("reserve") == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-gemma3"])
def test_decode_graph_replays_of_other_families_on_host(emulated, name):
    """The families whose layers differ from Llama's (q/k/v bias; Gemma 3's q/k norms, GELU, four norms a layer, two
    ropes and a sliding layer) through the decode graphs' shared workspace: replays give the eager steps' logits and
    KV (their own ops still allocate, from the graphs' private pool on a device)."""
    sys.modules["cupy"].__getattr__ = lambda attr: getattr(np, attr)  # Gemma 3's GELU: CuPy array code
    gpu_helpers.check_decode_graph_replays(name, RecordingCapturer())


def test_device_metadata_on_host(emulated):
    gpu_helpers.check_device_metadata_and_table_width_change_nothing()


def test_engine_on_host_with_graphs_and_device_sampling(emulated, monkeypatch):
    """LLMEngine(device="cuda") on the emulation: graphs (fake capture) and eager give the same tokens;
    the sampler runs on the stand-in CuPy arrays with greedy rows through the argmax_rows kernel."""
    from pagedserve.runtime.worker import cuda_graphs
    from pagedserve.runtime.engine import model_runner
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine
    from pagedserve.runtime.sampling_params import SamplingParams

    def params(temperature, seed, n=1):
        return SamplingParams(temperature=temperature, seed=seed, n=n, top_k=40 if temperature else 0, max_tokens=10,
                              ignore_eos=True)

    cp = sys.modules["cupy"]
    cp.__getattr__ = lambda name: getattr(np, name)  # the sampler's array API: numpy on EmulatedArray
    monkeypatch.setattr(cuda_graphs, "CupyGraphCapturer", RecordingCapturer)
    argmax_calls = []
    real_argmax = cuda_ops.argmax_rows
    monkeypatch.setattr(cuda_ops, "argmax_rows", lambda a: argmax_calls.append(a.shape) or real_argmax(a))
    results = {}
    for graphs_on in (True, False):
        engine = LLMEngine(EngineConfig(device="cuda", num_kv_blocks=64, max_num_seqs=4, enable_cuda_graphs=graphs_on,
                                        cuda_graph_batch_sizes=(1, 2, 4), seed=0), loaded=gpu_helpers.tiny_loaded())
        assert engine.backend.is_gpu and isinstance(engine.runner.xp, model_runner._DeviceArrayModule)
        rng = np.random.default_rng(2)
        requests = [
            ("greedy", rng.integers(3, 500, 30).tolist(), params(0.0, None)),
            ("seeded", rng.integers(3, 500, 7).tolist(), params(0.9, 5)),
            ("n2", rng.integers(3, 500, 50).tolist(), params(1.0, 6, n=2)),
        ]
        results[graphs_on] = gpu_helpers.generate(engine, requests)
        if graphs_on:
            assert engine.runner.graphs.num_replays >= 8
    assert argmax_calls, "greedy rows did not go through cuda_ops.argmax_rows"
    assert results[True] == results[False]


@pytest.mark.slow
def test_engine_on_host_with_a_bfloat16_pool(emulated, monkeypatch):
    """LLMEngine(device="cuda", kv_cache_dtype="bfloat16") on the emulation: a uint16 pool (bfloat16's bits) that the
    CUDA cache write fills and the attention reads (kv_types.cuh), eager and through (fake-captured) graphs with the
    same tokens, and another result than the float16 pool's (the rounding is there: each op's bits are checked
    against the reference by test_kv_dtype_*); fp8 is refused at start naming the value and the choices."""
    from pagedserve.runtime.config import EngineConfig
    from pagedserve.runtime.engine.llm_engine import LLMEngine
    from pagedserve.runtime.sampling_params import SamplingParams
    from pagedserve.runtime.worker import cuda_graphs

    sys.modules["cupy"].__getattr__ = lambda name: getattr(np, name)
    monkeypatch.setattr(cuda_graphs, "CupyGraphCapturer", RecordingCapturer)
    rng = np.random.default_rng(2)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    requests = [(f"r{i}", rng.integers(3, 500, n).tolist(), greedy) for i, n in enumerate((30, 7, 50))]
    results = {}
    for dtype, graphs in (("auto", False), ("bfloat16", False), ("bfloat16", True)):
        engine = LLMEngine(EngineConfig(device="cuda", num_kv_blocks=64, max_num_seqs=4, enable_cuda_graphs=graphs,
                                        cuda_graph_batch_sizes=(1, 2, 4), seed=0, kv_cache_dtype=dtype),
                           loaded=gpu_helpers.tiny_loaded())
        storage = engine.executor.driver_worker.kv_caches[0][0].dtype
        assert storage == (np.float16 if dtype == "auto" else np.uint16)
        results[dtype, graphs] = gpu_helpers.generate(engine, requests)
    assert results["bfloat16", True] == results["bfloat16", False]
    assert results["bfloat16", False] != results["auto", False]
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'fp8_e4m3' .*cuda kernel set; choose one of auto, float16, "
                                         r"bfloat16$"):
        LLMEngine(EngineConfig(device="cuda", num_kv_blocks=64, kv_cache_dtype="fp8"), loaded=gpu_helpers.tiny_loaded())


def test_attention_over_sequence_ranges_is_bitwise_the_same_on_host(emulated, monkeypatch):
    """With the partial buffer capped, long decodes run in several launches over ranges of sequences:
    the partials never exceed the cap and every row is bit for bit what one launch gives."""
    rng = np.random.default_rng(11)
    specs = [(1100, 1), (40, 40), (700, 1), (1500, 1), (17, 1), (530, 3), (900, 1)]
    k, v, qsl, lens, tables = build_cache(rng, specs, 2, 64, 16)
    query = rng.standard_normal((int(qsl[-1]), 4, 64)).astype(np.float16)
    whole = cuda.paged_attention(_dev(query), _dev(k), _dev(v), qsl, lens, tables, 0.125).get()
    per_seq = cuda_ops.partition_bytes_per_seq(4, 64, 3)
    cap = 2 * per_seq + 100  # two sequences per launch: four launches for seven sequences
    monkeypatch.setattr(cuda_attention, "PARTITION_SCRATCH_BYTES", cap)
    cp = sys.modules["cupy"]
    sizes = []
    real_empty = cp.empty
    cp.empty = lambda shape, dtype=np.float64: sizes.append((tuple(np.atleast_1d(shape)), np.dtype(dtype))) or \
        real_empty(shape, dtype)
    for metadata in ((qsl, lens, tables), (_dev(qsl), _dev(lens), _dev(tables))):
        sizes.clear()
        got = cuda.paged_attention(_dev(query), _dev(k), _dev(v), *metadata, 0.125).get()
        np.testing.assert_array_equal(got, whole)
        partials = [int(np.prod(s)) * 4 for s, d in sizes if d == np.float32]
        assert partials and sum(partials) <= cap, sizes


# ---------------------------------------------------------------------------------------------
# Tensor-core prefill attention (prefill_attention.cu: mma.sync m16n8k16 through the emulator's fragment model)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def tc_prefill(emulated, monkeypatch):
    """The tensor-core prefill path switched on, on an sm_90 stand-in."""
    monkeypatch.setattr(cuda_attention, "_compute_capability", lambda: 90)
    monkeypatch.setenv(cuda_attention.TC_PREFILL_ENV, "1")


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("dim,block_size,group", [(64, 16, 2), (128, 32, 1), (256, 16, 4)])
def test_prefill_attention_tensor_cores_on_host(emulated, kind, dim, block_size, group):
    """Against numpy: several tiles, ragged ends, GQA, chunks after a context; decode rows never written."""
    rng = np.random.default_rng(dim + group)
    specs = PREFILL_SPECS if dim < 256 else [(100, 100), (20, 1), (200, 45), (2, 2)]
    (q, k, v, qsl, lens, tables), floats = prefill_case(rng, specs, kind, 2, group, dim, block_size)
    scale = dim ** -0.5
    out = _garbage(q.shape, q.dtype)  # NaN / all-ones bits: rows left unwritten stay so
    cuda_attention.prefill_attention(_dev(q), _dev(k), _dev(v), qsl, lens, tables, scale, out=out)
    got = as_float32(out.get(), kind)
    rows = check_prefill(got, floats, qsl, lens, tables, scale, kind, what=f"{kind}/{dim}")
    untouched = np.setdiff1d(np.arange(len(q)), rows)
    assert untouched.size and np.all(out.get()[untouched].view(np.uint16) == 0xFFFF)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("window", [1, 37, 100])
def test_prefill_attention_tensor_cores_sliding_window_on_host(emulated, kind, window):
    """With a window: the reference's answer, and the same bits with every block wholly older than a sequence's
    window poisoned with NaN (the walk starts at the window's tile; older keys are never read)."""
    rng = np.random.default_rng(window)
    specs = [(300, 45), (150, 150), (20, 1), (129, 129)]
    (q, k, v, qsl, lens, tables), floats = prefill_case(rng, specs, kind, 2, 2, 64, 16)
    got = cuda_attention.prefill_attention(_dev(q), _dev(k), _dev(v), qsl, lens, tables, 0.125,
                                           sliding_window=window).get()
    rows = check_prefill(as_float32(got, kind), floats, qsl, lens, tables, 0.125, kind, window, f"{kind}/window")
    nan = np.float16(np.nan) if kind == "f16" else np.uint16(0x7FC0)
    poisoned = 0
    for i, length in enumerate(lens):
        oldest = max(0, int(length) - int(qsl[i + 1] - qsl[i]) - window + 1)
        for b in range(oldest // 16):
            k[tables[i, b]] = v[tables[i, b]] = nan
            poisoned += 1
    assert poisoned
    again = cuda_attention.prefill_attention(_dev(q), _dev(k), _dev(v), qsl, lens, tables, 0.125,
                                             sliding_window=window).get()
    np.testing.assert_array_equal(again[rows], got[rows])


def test_prefill_tensor_cores_chunked_or_alone_same_bits_on_host(emulated):
    """A 200-token prompt whole and in chunks of 31, 69 and 100 (each a CTA walk from another first row), and each
    sequence alone vs in a batch: the same bits (key tiles at fixed positions; skipped tiles are exact no-ops)."""
    rng = np.random.default_rng(12)
    (q, k, v, qsl, lens, tables), _ = prefill_case(rng, [(200, 200), (90, 70)], "bf16", 1, 4, 64, 16)
    for window in (None, 45):
        whole = cuda_attention.prefill_attention(_dev(q), _dev(k), _dev(v), qsl, lens, tables, 0.125,
                                                 sliding_window=window).get()
        for a, b in ((0, 31), (31, 100), (100, 200)):
            part = cuda_attention.prefill_attention(_dev(q[a:b]), _dev(k), _dev(v), np.array([0, b - a], np.int32),
                                                    np.array([b], np.int32), tables[:1], 0.125,
                                                    sliding_window=window).get()
            np.testing.assert_array_equal(part, whole[a:b])
        alone = cuda_attention.prefill_attention(_dev(q[200:]), _dev(k), _dev(v), np.array([0, 70], np.int32),
                                                 lens[1:], tables[1:], 0.125, sliding_window=window).get()
        np.testing.assert_array_equal(alone, whole[200:])


def test_paged_attention_with_tensor_core_prefill_on_host(tc_prefill, monkeypatch):
    """PAGEDSERVE_TC_PREFILL=1: a mixed batch is two launches (prefill rows on tensor cores, decodes on the paged
    kernel, which skips the prefill sequences); decode rows are bit for bit the flag-off ones; prefill rows within
    the bound; a decode-only batch is one launch; host and device metadata give the same bits."""
    rng = np.random.default_rng(21)
    (q, k, v, qsl, lens, tables), floats = prefill_case(rng, PREFILL_SPECS, "f16", 2, 4, 64, 16)
    launched = []
    real_kernel = cuda_attention._kernel
    monkeypatch.setattr(cuda_attention, "_kernel",
                        lambda module, name: launched.append(name.split("<")[0]) or real_kernel(module, name))
    got = cuda.paged_attention(_dev(q), _dev(k), _dev(v), qsl, lens, tables, 0.125, sliding_window=70).get()
    assert launched == ["prefill_attention_kernel", "paged_attention_kernel", "paged_attention_reduce_kernel"]
    rows = check_prefill(got.astype(np.float32), floats, qsl, lens, tables, 0.125, "f16", 70, "mixed")
    device = cuda.paged_attention(_dev(q), _dev(k), _dev(v), _dev(qsl), _dev(lens), _dev(tables), 0.125,
                                  sliding_window=70).get()
    np.testing.assert_array_equal(device, got)
    monkeypatch.setenv(cuda_attention.TC_PREFILL_ENV, "0")
    off = cuda.paged_attention(_dev(q), _dev(k), _dev(v), qsl, lens, tables, 0.125, sliding_window=70).get()
    decodes = np.setdiff1d(np.arange(len(q)), rows)
    np.testing.assert_array_equal(got[decodes], off[decodes])
    monkeypatch.setenv(cuda_attention.TC_PREFILL_ENV, "1")
    launched.clear()
    dq = q[decodes]
    dlens, dtables = lens[[1, 6]], tables[[1, 6]]
    cuda.paged_attention(_dev(dq), _dev(k), _dev(v), np.array([0, 1, 2], np.int32), dlens, dtables, 0.125)
    assert launched == ["paged_attention_kernel", "paged_attention_reduce_kernel"]


def test_tensor_core_prefill_flag(monkeypatch):
    """Off unless PAGEDSERVE_TC_PREFILL=1, and then only on sm_80+."""
    monkeypatch.setattr(cuda_attention, "_compute_capability", lambda: 90)
    monkeypatch.delenv(cuda_attention.TC_PREFILL_ENV, raising=False)
    assert not cuda_attention.tensor_core_prefill_enabled()
    monkeypatch.setenv(cuda_attention.TC_PREFILL_ENV, "1")
    assert cuda_attention.tensor_core_prefill_enabled()
    monkeypatch.setattr(cuda_attention, "_compute_capability", lambda: 75)
    assert not cuda_attention.tensor_core_prefill_enabled()


def test_prefill_attention_rejects_bad_input_on_host(emulated):
    rng = np.random.default_rng(1)
    (q, k, v, qsl, lens, tables), _ = prefill_case(rng, [(40, 40)], "f16", 1, 2, 64, 16)
    call = cuda_attention.prefill_attention
    with pytest.raises(ValueError, match="dtype"):
        call(_dev(q.astype(np.float32)), _dev(k), _dev(v), qsl, lens, tables, 0.1)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        call(_dev(q.astype(np.float32)), _dev(k.astype(np.float32)), _dev(v.astype(np.float32)), qsl, lens, tables,
             0.1)
    with pytest.raises(ValueError, match="head_dim"):
        call(_dev(q[..., :48]), _dev(k[..., :48]), _dev(v[..., :48]), qsl, lens, tables, 0.1)
    with pytest.raises(ValueError, match="out must be"):
        call(_dev(q), _dev(k), _dev(v), qsl, lens, tables, 0.1, out=_dev(q[:-1]))
    with pytest.raises(ValueError, match="sliding_window"):
        call(_dev(q), _dev(k), _dev(v), qsl, lens, tables, 0.1, sliding_window=-3)


@pytest.mark.parametrize("dim,group,window", [(64, 4, None), (128, 2, 37)])
def test_paged_attention_bf16_on_host(emulated, monkeypatch, dim, group, window):
    """bfloat16 query and caches (uint16 bits) through paged_attention: split decodes, chunks and prompts against
    numpy on the bf16 values; with PAGEDSERVE_TC_PREFILL=1 the decode rows are the same bits and the prefill rows
    (tensor cores) within the bound."""
    rng = np.random.default_rng(dim)
    (q, k, v, qsl, lens, tables), floats = prefill_case(rng, PREFILL_SPECS, "bf16", 2, group, dim, 16)
    got = cuda.paged_attention(_dev(q), _dev(k), _dev(v), qsl, lens, tables, 0.125, sliding_window=window).get()
    assert got.dtype == np.uint16
    check_prefill(as_float32(got, "bf16"), floats, qsl, lens, tables, 0.125, "bf16", window, "bf16", every_row=True)
    monkeypatch.setattr(cuda_attention, "_compute_capability", lambda: 80)
    monkeypatch.setenv(cuda_attention.TC_PREFILL_ENV, "1")
    tc = cuda.paged_attention(_dev(q), _dev(k), _dev(v), qsl, lens, tables, 0.125, sliding_window=window).get()
    rows = check_prefill(as_float32(tc, "bf16"), floats, qsl, lens, tables, 0.125, "bf16", window, "bf16/tc")
    decodes = np.setdiff1d(np.arange(len(q)), rows)
    np.testing.assert_array_equal(tc[decodes], got[decodes])


def test_gpu_attention_bench_prefill_case_on_host(emulated, monkeypatch):
    """bench/gpu_attention.py's prefill case on the emulation (a stand-in for CuPy's random, events and reductions):
    both paths run, its bf16 conversion and the flag switching hold, the two paths agree, the flag is restored."""
    import runpy

    bench = runpy.run_path(str(Path(__file__).parents[2] / "bench" / "gpu_attention.py"), run_name="not_main")
    cp = sys.modules["cupy"]
    rng = np.random.default_rng(0)
    cp.uint16, cp.uint32 = np.uint16, np.uint32
    cp.random = types.SimpleNamespace(standard_normal=lambda shape, dtype: _dev(rng.standard_normal(shape), dtype))
    cp.isfinite = lambda a: np.isfinite(np.asarray(a))
    cp.abs = lambda a: np.abs(np.asarray(a))
    event = types.SimpleNamespace(record=lambda: None, synchronize=lambda: None)
    cp.cuda.Event = lambda: event
    cp.cuda.get_elapsed_time = lambda a, b: 1.0
    monkeypatch.setattr(cuda_attention, "_compute_capability", lambda: 90)
    monkeypatch.delenv(cuda_attention.TC_PREFILL_ENV, raising=False)
    row = bench["_prefill_case"](cp, 40, 64, "bf16", 16, 1, True)
    assert row["paged"]["finite"] and row["tensor_cores"]["finite"], row
    assert 0 < row["max_abs_diff_tc_vs_paged"] < 0.05, row  # bf16 P in the tensor-core path; fp32 P in the paged one
    assert cuda_attention.TC_PREFILL_ENV not in os.environ
    row = bench["_prefill_case"](cp, 20, 256, "fp16", 16, 1, True)  # head dim 256: the paged kernel too (#35)
    assert row["paged"]["finite"] and row["tensor_cores"]["finite"], row
    assert 0 < row["max_abs_diff_tc_vs_paged"] < 0.05, row


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_lora_shrink_expand_on_host(emulated, dtype):
    """lora.cu (cupy_kernels/cuda/lora.py) against reference/lora.py: per-row slots, a zero-padded rank, base rows
    left untouched, bit for bit."""
    from pagedserve.cupy_kernels.cuda import lora as cuda_lora
    from pagedserve.cupy_kernels.reference import lora as ref

    rng = np.random.default_rng(61)
    T, L, R, n_in, n_out = 37, 4, 16, 200, 72
    x = rng.standard_normal((T, n_in)).astype(dtype)
    a = (rng.standard_normal((L, R, n_in)) * 0.3).astype(dtype)
    b = (rng.standard_normal((L, R, n_out)) * 0.3).astype(dtype)  # B transposed: [R, out] a slot
    a[1, 8:], b[1, 8:] = 0, 0  # slot 1: rank 8 of 16
    scale = rng.uniform(0.5, 2.0, L).astype(np.float32)
    slots = rng.integers(0, L, T).astype(np.int32)
    slots[::3] = -1
    slots[10:20] = 2
    y = rng.standard_normal((T, n_out)).astype(dtype)
    f32 = lambda v: v.astype(np.float32)  # noqa: E731
    t_want = ref.lora_shrink(f32(x), f32(a), slots)
    want = ref.lora_expand(t_want, f32(b), scale, slots, f32(y))
    t = cuda_lora.lora_shrink(_dev(x), _dev(a), _dev(slots))
    np.testing.assert_allclose(t.get(), t_want, rtol=0, atol=1e-4 * np.abs(t_want).max())
    got = cuda_lora.lora_expand(t, _dev(b), _dev(scale), _dev(slots), _dev(y)).get()
    base = slots < 0
    np.testing.assert_array_equal(got[base], y[base])
    atol = (2e-3 if dtype == np.float16 else 1e-5) * np.abs(want).max()  # float16: the output's rounding
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=0, atol=atol)
    assert np.abs(want[~base] - f32(y)[~base]).max() > 100 * atol  # the deltas are far above the tolerance


def test_lora_model_forward_on_host(emulated, tmp_path):
    """The CUDA forward (float16, lora.cu through the CUDA op table, the slots uploaded by device_batch) with two
    adapters and the base in one mixed step, then a decode step, against the numpy float32 model with each adapter
    merged into its weights (W + scale B A)."""
    from lora_helpers import make_lora
    from pagedserve.cupy_kernels.backend import get_backend, to_host
    from pagedserve.models import lora as model_lora, registry
    from pagedserve.models.batch import SeqChunk, build_forward_batch
    from pagedserve.models.kv_cache import allocate_kv_caches
    from pagedserve.models.loading.peft import load_peft_adapter

    cfg, weights = gpu_helpers.load_tiny("tiny-llama")
    cls = registry.for_config(cfg).model_class
    adapters = [load_peft_adapter(make_lora(tmp_path / f"a{k}", cfg, rank=8, std=0.15, seed=k, targets=t), cfg)
                for k, t in enumerate([("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                       ("q_proj", "v_proj")])]
    gpu = cls(cfg, weights, get_backend("cuda"))
    model_lora.attach(gpu, weights, max_loras=3, max_lora_rank=8)
    gpu.lora.set(2, adapters[0])
    gpu.lora.set(0, adapters[1])

    def merged(adapter):
        w = dict(weights)
        for (n, module), (a, b) in adapter.weights.items():
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"model.layers.{n}.{block}.{module}.weight"
            w[name] = (w[name] + adapter.scale * (b @ a)).astype(np.float32)
        return cls(cfg, w, get_backend("cpu"))

    refs = [merged(adapters[0]), cls(cfg, weights, get_backend("cpu")), merged(adapters[1])]
    slots = [2, -1, 0]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (9, 23, 17)]
    kv_gpu = allocate_kv_caches(cfg, 12, 16, get_backend("cuda"))
    kv_cpu = [allocate_kv_caches(cfg, 12, 16, get_backend("cpu")) for _ in refs]
    tables = [[0, 1], [2, 3], [4, 5]]
    chunks = [SeqChunk(p, 0, t, lora_slot=s) for p, t, s in zip(prompts, tables, slots)]
    for step in range(2):
        got = to_host(gpu.forward(build_forward_batch(chunks, 16), kv_gpu))
        nxt = []
        for i, (ref, kv) in enumerate(zip(refs, kv_cpu)):
            c = chunks[i]
            want = ref.forward(build_forward_batch([SeqChunk(c.token_ids, c.num_computed_tokens, c.block_table)], 16),
                               kv)
            gpu_helpers.compare_logits(got[i:i + 1], want, f"lora/step{step}/{i}")
            nxt.append(int(want[0].argmax()))
        chunks = [SeqChunk([t], len(p) if step == 0 else len(p) + 1, tb, lora_slot=s)
                  for t, p, tb, s in zip(nxt, prompts, tables, slots)]
