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


def attention_kernel_name(head_dim: int, block_size: int, block_m: int, dtype: str = "f16") -> str:
    suffix = "" if dtype == "f16" else f", {dtype}"
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


def _large_attention_shared() -> tuple[tuple[str, int], ...]:
    """(name expression, dynamic bytes) of the paged attention instantiations whose shared memory, dynamic and static,
    passes DEFAULT_SHARED_LIMIT: head dim 256 at block_m 16 and 32."""
    return tuple((attention_kernel_name(d, bs, m, t), attention_shared_bytes(d, m))
                 for t in ATTN_TYPES for d in ATTN_HEAD_DIMS for bs in ATTN_BLOCK_SIZES for m in ATTN_BLOCK_MS
                 if attention_shared_bytes(d, m) + attention_static_shared_bytes(m) > DEFAULT_SHARED_LIMIT)


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

    def source(self) -> str:
        """The exact string compiled, by CuPy on a GPU machine and by nvcc in the compile test."""
        defines = "".join(f"#define {key} {value}\n" for key, value in self.defines)
        common = (KERNEL_DIR / "common.cu").read_text()
        preludes = "".join((KERNEL_DIR / p).read_text() + "\n" for p in self.preludes)
        return defines + common + "\n" + preludes + (KERNEL_DIR / self.source_file).read_text()


MODULES: dict[str, KernelModule] = {
    m.name: m
    for m in (
        KernelModule(
            "paged_attention",
            "paged_attention.cu",
            (("PS_ATTN_THREADS", ATTN_THREADS), ("PS_TILE_N", ATTN_TILE_N), ("PS_PARTITION_SIZE", PARTITION_SIZE)),
            tuple(attention_kernel_name(d, bs, m, t) for t in ATTN_TYPES for d in ATTN_HEAD_DIMS
                  for bs in ATTN_BLOCK_SIZES for m in ATTN_BLOCK_MS)
            + tuple(attention_reduce_name(d, t) for t in ATTN_TYPES for d in ATTN_HEAD_DIMS),
            preludes=("tensor_core.cuh",),
            large_shared=_large_attention_shared(),
        ),
        KernelModule(
            "prefill_attention",
            "prefill_attention.cu",
            (("PS_PREFILL_THREADS", PREFILL_THREADS), ("PS_PREFILL_BLOCK_Q", PREFILL_BLOCK_Q)),
            tuple(prefill_kernel_name(d, bs, t) for d in PREFILL_HEAD_DIMS for bs in ATTN_BLOCK_SIZES
                  for t in PREFILL_TYPES),
            preludes=("tensor_core.cuh",),
        ),
        KernelModule("cache_ops", "cache_ops.cu", (), _typed("reshape_and_cache_kernel") + ("copy_blocks_kernel",)),
        KernelModule("norm", "norm.cu", (), _typed("add_rms_norm_kernel")),
        KernelModule("rotary", "rotary.cu", (), _typed("rotary_kernel")),
        KernelModule("activation", "activation.cu", (), _typed("silu_and_mul_kernel")),
        KernelModule("sampling", "sampling.cu", (), _typed("argmax_rows_kernel") + _typed("sample_rows_kernel")),
        KernelModule("lora", "lora.cu", (), _typed("lora_shrink_kernel") + _typed("lora_expand_kernel")),
    )
}
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
    """The function of one name expression, loaded once per device; opted in to its dynamic shared memory
    (KernelModule.large_shared) when that is above DEFAULT_SHARED_LIMIT."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    key = (module, name, device)
    fn = _functions.get(key)
    if fn is None:
        spec = MODULES[module]
        mod = _modules.get((module, device))
        if mod is None:
            mod = _modules[(module, device)] = _load_module(spec)
        fn = mod.get_function(name)
        shared = dict(spec.large_shared).get(name, 0)
        if shared:
            _allow_shared(fn, shared, device)
        _functions[key] = fn
    return fn
