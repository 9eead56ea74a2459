"""The CUDA kernels' module table, and their compilation and loading.

Kernels live in the .cu files next to this module, one per family. MODULES below is the single table
of what is compiled: the source string of each module (its #defines + common.cu + the family's file)
and the template instantiations (NVRTC name expressions) that are asked for. `_kernel` loads them with
cupy.RawModule (or from pagedserve's on-disk kernel cache, kernel_cache.py) and
tests/cupy_kernels/test_nvcc_compile.py compiles the very same strings with nvcc for sm_80 and sm_90, so a
kernel that does not compile fails CI on a machine without a GPU.

Compiler options: ("-std=c++17",) and nothing else. Not --use_fast_math: it would turn every division
and sqrt into approximations and let the compiler contract float32 expressions differently per
instantiation; the few places that want speed (exp2f in the softmax) ask for it explicitly. CuPy
itself appends "-ftz=true" (float32 denormals flush to zero; cupy/cuda/compiler.py), which only
touches values below 1e-38 and is the same for every launch.

CuPy is imported inside the functions only: importing this module never needs CuPy or a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import kernel_cache

KERNEL_DIR = Path(__file__).parent

NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17",)
# Appended by CuPy to every compile (cupy.cuda.compiler._compile_with_cache_cuda); the nvcc check
# passes them too so that it compiles what CuPy compiles.
CUPY_IMPLICIT_OPTIONS: tuple[str, ...] = ("-ftz=true",)

# Paged attention constants (mirrored into the .cu source as #defines).
ATTN_THREADS = 128  # 4 warps per CTA
ATTN_TILE_N = 32  # keys per shared-memory tile: one lane per key in the softmax
PARTITION_SIZE = 512  # keys per partition of a split decode
ATTN_HEAD_DIMS = (64, 128, 256)  # 256: Gemma 3 (dynamic shared memory above 48 KB, attention_shared_bytes)
ATTN_BLOCK_SIZES = (16, 32)
ATTN_BLOCK_MS = (4, 8, 16, 32)  # rows (query tokens x heads of one group) per CTA
MAX_QUERIES_PER_KV = max(ATTN_BLOCK_MS)
# Shared memory (static + dynamic) a CTA may use without opting in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES).
DEFAULT_SHARED_LIMIT = 48 * 1024
LOG2E = 1.4426950408889634

# Tensor-core prefill attention (prefill_attention.cu): 64 query rows per CTA (4 warps x 16), keys per tile.
PREFILL_THREADS = 128
PREFILL_BLOCK_Q = 64
PREFILL_HEAD_DIMS = (64, 128, 256)
PREFILL_TYPES = ("f16", "bf16")


def prefill_kernel_name(head_dim: int, block_size: int, dtype: str) -> str:
    return f"prefill_attention_kernel<{head_dim}, {block_size}, {dtype}>"


# Storage dtypes of the elementwise kernels -> the C++ type name used in their instantiations.
STORAGE_TYPES = {np.dtype(np.float16): "f16", np.dtype(np.float32): "float"}


ATTN_TYPES = ("f16", "bf16")  # storage type of query, caches and out (the template's T; f16 by default)
# The caches' element types (kv_types.cuh; the template's KV, T's by default) besides T's own, for a float16 model
# (the GPU backend's dtype): kv_cache_dtype -> the C++ type. fp8 caches are uint8 arrays (CuPy has no fp8 dtype).
KV_TYPES = {"float16": "f16", "bfloat16": "bf16", "fp8_e4m3": "kv_fp8e4m3", "fp8_e5m2": "kv_fp8e5m2"}
ATTN_KV_TYPES = ("bf16", "kv_fp8e4m3", "kv_fp8e5m2")  # with T = f16
# fp8 caches: no 32-row tile (> 16 query heads per kv head): under the 128-register cap its score loop with the fp8
# conversion spilled 144 bytes at head dim 256 on sm_90 (ptxas, CUDA 13.0); paged_attention refuses those groups.
FP8_BLOCK_MS = (4, 8, 16)


def attention_kernel_name(head_dim: int, block_size: int, block_m: int, dtype: str = "f16", kv: str | None = None
                          ) -> str:
    suffix = "" if dtype == "f16" else f", {dtype}"
    if kv not in (None, dtype):  # caches of another element type than the query's
        suffix = f", {dtype}, {kv}"
    return f"paged_attention_kernel<{head_dim}, {block_size}, {block_m}{suffix}>"


def attention_reduce_name(head_dim: int, dtype: str = "f16") -> str:
    suffix = "" if dtype == "f16" else f", {dtype}"
    return f"paged_attention_reduce_kernel<{head_dim}{suffix}>"


def attention_shared_bytes(head_dim: int, block_m: int) -> int:
    """Dynamic shared memory of one paged_attention_kernel CTA, what its launch passes (AttentionSmem in
    paged_attention.cu; either 2-byte storage type): queries in float32, a K and a V tile of ATTN_TILE_N keys (rows
    padded by 8 elements), the scores. Head dim 256: 38,416 / 43,040 / 52,288 / 70,784 bytes at block_m 4 / 8 / 16
    / 32."""
    return block_m * head_dim * 4 + 2 * ATTN_TILE_N * (head_dim + 8) * 2 + block_m * (ATTN_TILE_N + 1) * 4


def attention_static_shared_bytes(block_m: int) -> int:
    """The kernel's static shared memory: five per-row words (alpha, m, l, pos, lo). ptxas reports it (the nvcc
    test holds the two equal); with the dynamic part above DEFAULT_SHARED_LIMIT the kernel is opted in (_kernel)."""
    return 5 * block_m * 4


def _typed(name: str) -> tuple[str, ...]:
    return tuple(f"{name}<{t}>" for t in STORAGE_TYPES.values())


@dataclass(frozen=True)
class KernelModule:
    """One RawModule: a kernel family's .cu file, the #defines it needs, the instantiations asked for."""

    name: str
    source_file: str
    defines: tuple[tuple[str, int], ...]
    name_expressions: tuple[str, ...]
    preludes: tuple[str, ...] = ()  # helper files (.cuh) placed between common.cu and the family's file
    # (name expression, bytes of dynamic shared memory its launches use) where that and the static shared memory
    # pass DEFAULT_SHARED_LIMIT: _kernel opts those functions in to that much
    large_shared: tuple[tuple[str, int], ...] = ()
    family: str = ""  # the kernel family callers name (_kernel): "" for a module that is its own family

    @property
    def family_name(self) -> str:
        return self.family or self.name

    def source(self) -> str:
        """The exact string compiled, by CuPy on a GPU machine and by nvcc in the compile test."""
        defines = "".join(f"#define {key} {value}\n" for key, value in self.defines)
        common = (KERNEL_DIR / "common.cu").read_text()
        preludes = "".join((KERNEL_DIR / p).read_text() + "\n" for p in self.preludes)
        return defines + common + "\n" + preludes + (KERNEL_DIR / self.source_file).read_text()


def attention_module_name(family: str, dtype: str, head_dim: int, kv: str | None = None) -> str:
    """The module holding `family`'s kernels (paged_attention, prefill_attention) for one storage type and head dim:
    "paged_attention_f16_d128" ("paged_attention_f16_kv_fp8e4m3_d128" for caches of element type kv). The sliding
    window is a run-time argument of both kernels, not an instantiation, so one module serves every window."""
    if kv in (None, dtype):
        return f"{family}_{dtype}_d{head_dim}"
    return f"{family}_{dtype}_kv_{kv.removeprefix('kv_')}_d{head_dim}"


def _paged_attention_module(dtype: str, dim: int, kv: str | None = None) -> KernelModule:
    block_ms = FP8_BLOCK_MS if kv is not None and kv.startswith("kv_fp8") else ATTN_BLOCK_MS
    names = tuple(attention_kernel_name(dim, bs, m, dtype, kv) for bs in ATTN_BLOCK_SIZES for m in block_ms)
    names += (attention_reduce_name(dim, dtype),)
    large = tuple((attention_kernel_name(dim, bs, m, dtype, kv), attention_shared_bytes(dim, m))
                  for bs in ATTN_BLOCK_SIZES for m in block_ms
                  if attention_shared_bytes(dim, m) + attention_static_shared_bytes(m) > DEFAULT_SHARED_LIMIT)
    return KernelModule(
        attention_module_name("paged_attention", dtype, dim, kv), "paged_attention.cu",
        (("PS_ATTN_THREADS", ATTN_THREADS), ("PS_TILE_N", ATTN_TILE_N), ("PS_PARTITION_SIZE", PARTITION_SIZE)),
        names, preludes=("tensor_core.cuh", "kv_types.cuh"), family="paged_attention", large_shared=large)


def _prefill_attention_module(dtype: str, dim: int) -> KernelModule:
    return KernelModule(
        attention_module_name("prefill_attention", dtype, dim), "prefill_attention.cu",
        (("PS_PREFILL_THREADS", PREFILL_THREADS), ("PS_PREFILL_BLOCK_Q", PREFILL_BLOCK_Q)),
        tuple(prefill_kernel_name(dim, bs, dtype) for bs in ATTN_BLOCK_SIZES), preludes=("tensor_core.cuh",),
        family="prefill_attention")


# The attention families are split into one module per (storage type, head dim), each compiled on first use: a
# float16 head-dim-128 model never compiles the bfloat16 or head-dim-256 kernels (issue 59: one module of all 54
# paged attention instantiations took 94 s of nvcc for sm_90). A storage type added to ATTN_TYPES / PREFILL_TYPES
# adds its modules here.
_ATTENTION_MODULES = tuple(_paged_attention_module(t, d) for t in ATTN_TYPES for d in ATTN_HEAD_DIMS) + tuple(
    _paged_attention_module("f16", d, kv) for kv in ATTN_KV_TYPES for d in ATTN_HEAD_DIMS) + tuple(
    _prefill_attention_module(t, d) for t in PREFILL_TYPES for d in PREFILL_HEAD_DIMS)

MODULES: dict[str, KernelModule] = {
    m.name: m
    for m in _ATTENTION_MODULES + (
        KernelModule("cache_ops", "cache_ops.cu", (), _typed("reshape_and_cache_kernel") + ("copy_blocks_kernel",)
                     + tuple(f"reshape_and_cache_kv_kernel<f16, {kv}>" for kv in ATTN_KV_TYPES),
                     preludes=("tensor_core.cuh", "kv_types.cuh")),
        KernelModule("norm", "norm.cu", (), _typed("add_rms_norm_kernel")),
        KernelModule("rotary", "rotary.cu", (), _typed("rotary_kernel") + ("rope_cos_sin_kernel",)),
        KernelModule("activation", "activation.cu", (), _typed("silu_and_mul_kernel") + _typed("to_float32_kernel")),
        KernelModule("embedding", "embedding.cu", (), _typed("embedding_kernel")),
        KernelModule("sampling", "sampling.cu", (), _typed("argmax_rows_kernel") + _typed("sample_rows_kernel")),
        KernelModule("lora", "lora.cu", (), _typed("lora_shrink_kernel") + _typed("lora_expand_kernel")),
    )
}
# Kernel families -> their modules: _kernel(family, name expression) finds the module that holds the name.
FAMILIES: dict[str, tuple[str, ...]] = {}
for _m in MODULES.values():
    FAMILIES[_m.family_name] = FAMILIES.get(_m.family_name, ()) + (_m.name,)
# A name instantiated in several modules of a family (the reduce kernel sits in every KV element type's module of
# its query type and head dim) maps to the first: the query's own module, which a step loads anyway.
_MODULE_OF: dict[tuple[str, str], str] = {}
for _f, _ms in FAMILIES.items():
    for _m in _ms:
        for _n in MODULES[_m].name_expressions:
            _MODULE_OF.setdefault((_f, _n), _m)


def family_name_expressions(family: str) -> tuple[str, ...]:
    """Every instantiation of a kernel family, over all its modules."""
    return tuple(n for m in FAMILIES[family] for n in MODULES[m].name_expressions)


def model_modules(dtype: str, head_dim: int) -> tuple[str, ...]:
    """The modules one model's forward and sampler load: its storage type's and head dim's attention modules (the
    tensor-core prefill's where that head dim has one), and every elementwise family (their float16 and float32
    instantiations are one module each). What scripts/gpu_precompile.py compiles ahead."""
    if dtype not in ATTN_TYPES or head_dim not in ATTN_HEAD_DIMS:
        raise ValueError(f"dtype/head_dim: no paged attention kernels for ({dtype!r}, {head_dim}); "
                         f"types {ATTN_TYPES}, head dims {ATTN_HEAD_DIMS}")
    out = [attention_module_name("paged_attention", dtype, head_dim)]
    if dtype in PREFILL_TYPES and head_dim in PREFILL_HEAD_DIMS:
        out.append(attention_module_name("prefill_attention", dtype, head_dim))
    return tuple(out) + tuple(m for f, ms in FAMILIES.items() if f not in ("paged_attention", "prefill_attention")
                              for m in ms)


# Files that are not modules of their own: prepended to every module's source.
SHARED_SOURCES = ("common.cu",)


# ---------------------------------------------------------------------------------------------
# Loading (once per process and device; functions by name expression)
# ---------------------------------------------------------------------------------------------

_modules: dict[tuple[str, int], Any] = {}
_functions: dict[tuple[str, str, int], Any] = {}
_log = logging.getLogger("pagedserve.kernels")


class _CachedModule:
    """A module loaded from kernel_cache's binary: functions by name expression, like RawModule's."""

    def __init__(self, module: Any, lowered_names: dict[str, str]) -> None:
        self.module = module
        self.lowered_names = lowered_names

    def get_function(self, name: str):
        return self.module.get_function(self.lowered_names[name])


def _make_kernel_cache() -> kernel_cache.KernelCache:
    return kernel_cache.KernelCache(kernel_cache.default_cache_dir(), kernel_cache.nvrtc_compile,
                                    kernel_cache.nvrtc_version())


def _load_module(spec: KernelModule):
    """The module from pagedserve's on-disk kernel cache (compiled by NVRTC on a miss), else - cache
    off, or any failure of that path (no NVRTC bindings, an architecture NVRTC does not know) -
    CuPy's RawModule, which compiles in memory in every process."""
    import cupy

    code = spec.source()
    if kernel_cache.cache_enabled():
        try:
            compiled = _make_kernel_cache().get(code, NVRTC_OPTIONS + CUPY_IMPLICIT_OPTIONS, kernel_cache.device_arch(),
                                                spec.name_expressions)
            module = cupy.cuda.function.Module()
            module.load(compiled.image)
            return _CachedModule(module, compiled.lowered_names)
        except Exception as e:  # noqa: BLE001 - the uncached path below still works
            _log.warning("kernel cache unusable for module %s (%s: %s); compiling in memory", spec.name,
                         type(e).__name__, e)
    return cupy.RawModule(code=code, options=NVRTC_OPTIONS, name_expressions=spec.name_expressions)


def _allow_shared(fn, nbytes: int, device: int) -> None:
    """Let `fn` launch with `nbytes` of dynamic shared memory, past DEFAULT_SHARED_LIMIT (a CTA may opt in to 163 KB
    on sm_80, 99 KB on sm_86/89, 227 KB on sm_90). fn: a cupy.RawKernel (RawModule.get_function) or, from the
    kernel cache, a cupy.cuda.function.Function."""
    import cupy

    runtime = cupy.cuda.runtime
    limit = runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device)
    if nbytes > limit:
        raise ValueError(f"kernel needs {nbytes} bytes of shared memory a CTA; device {device} allows {limit}")
    if isinstance(fn, cupy.RawKernel):
        fn.max_dynamic_shared_size_bytes = nbytes
    else:
        driver = cupy.cuda.driver
        driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)


def _kernel(module: str, name: str):
    """The function of one name expression of a module or a kernel family (FAMILIES: paged_attention's module for
    that name's storage type and head dim), its module loaded on first use, once per device; opted in to its
    dynamic shared memory (KernelModule.large_shared) when that is above DEFAULT_SHARED_LIMIT."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    key = (module, name, device)
    fn = _functions.get(key)
    if fn is None:
        module_name = _MODULE_OF.get((module, name), module)  # a family's name: the module holding `name`
        spec = MODULES[module_name]
        mod = _modules.get((module_name, device))
        if mod is None:
            mod = _modules[(module_name, device)] = _load_module(spec)
        fn = mod.get_function(name)
        shared = dict(spec.large_shared).get(name, 0)
        if shared:
            _allow_shared(fn, shared, device)
        _functions[key] = fn
    return fn
