"""CUDA implementations of the op layer, for CuPy arrays.

Every function here has the signature of its numpy reference in ops.py / paged_attention.py; the CUDA
backend's op table (kernel_set.cuda_kernels) holds them. CuPy is imported inside the functions only, so importing
this module (and with it pagedserve.cupy_kernels) never needs CuPy or a GPU.

Kernels live in the .cu files next to this module, one per family. MODULES below is the single table
of what is compiled: the source string of each module (its #defines + common.cu + the family's file)
and the template instantiations (NVRTC name expressions) that are asked for. cuda_ops loads them with
cupy.RawModule and tests/cupy_kernels/test_nvcc_compile.py compiles the very same strings with nvcc
for sm_80 and sm_90, so a kernel that does not compile fails CI on a machine without a GPU.

Compiler options: ("-std=c++17",) and nothing else. Not --use_fast_math: it would turn every division
and sqrt into approximations and let the compiler contract float32 expressions differently per
instantiation; the few places that want speed (exp2f in the softmax) ask for it explicitly. CuPy
itself appends "-ftz=true" (float32 denormals flush to zero; cupy/cuda/compiler.py), which only
touches values below 1e-38 and is the same for every launch.

Embedding and linear use CuPy directly: `cupy.take` and `x @ weight_t`. For float16 operands CuPy's
matmul calls cublasGemmEx with compute type CUBLAS_COMPUTE_32F and tensor-op algorithms
(cupy/_core/_routines_linalg.pyx, tensordot_core_v11): float16 storage, float32 accumulation, one
rounding of the result to float16. cupy's COMPUTE_TYPE_FP16 setting is not honoured by that path,
so no global state can make it accumulate in float16 behind our back.

Host metadata. When slot_mapping / query_start_loc / seq_lens / block_tables arrive as numpy arrays
they are checked on the host (sizes, ranges, block ids) and uploaded. As CuPy arrays they are used as
they are, without a device sync: slots outside the cache are then skipped silently, and the attention
sizes its partition workspace from block_tables.shape[1] instead of max(seq_lens).
"""

from __future__ import annotations

import logging
import math
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
# Most bytes of float32 partials (acc + max/sum) one attention launch may use. A batch whose split
# decodes would need more runs in several launches over ranges of sequences (each with this much at
# most), so 256 sequences at 131,072 tokens (1 GiB of partials in one launch) cost 64 MiB, not 1 GiB.
PARTITION_SCRATCH_BYTES = 64 << 20
ATTN_HEAD_DIMS = (64, 128)
ATTN_BLOCK_SIZES = (16, 32)
ATTN_BLOCK_MS = (4, 8, 16, 32)  # rows (query tokens x heads of one group) per CTA
MAX_QUERIES_PER_KV = max(ATTN_BLOCK_MS)
LOG2E = 1.4426950408889634

# Storage dtypes of the elementwise kernels -> the C++ type name used in their instantiations.
STORAGE_TYPES = {np.dtype(np.float16): "f16", np.dtype(np.float32): "float"}


def attention_kernel_name(head_dim: int, block_size: int, block_m: int) -> str:
    return f"paged_attention_kernel<{head_dim}, {block_size}, {block_m}>"


def attention_reduce_name(head_dim: int) -> str:
    return f"paged_attention_reduce_kernel<{head_dim}>"


def _typed(name: str) -> tuple[str, ...]:
    return tuple(f"{name}<{t}>" for t in STORAGE_TYPES.values())


@dataclass(frozen=True)
class KernelModule:
    """One RawModule: a kernel family's .cu file, the #defines it needs, the instantiations asked for."""

    name: str
    source_file: str
    defines: tuple[tuple[str, int], ...]
    name_expressions: tuple[str, ...]

    def source(self) -> str:
        """The exact string compiled, by CuPy on a GPU machine and by nvcc in the compile test."""
        defines = "".join(f"#define {key} {value}\n" for key, value in self.defines)
        common = (KERNEL_DIR / "common.cu").read_text()
        return defines + common + "\n" + (KERNEL_DIR / self.source_file).read_text()


MODULES: dict[str, KernelModule] = {
    m.name: m
    for m in (
        KernelModule(
            "paged_attention",
            "paged_attention.cu",
            (("PS_ATTN_THREADS", ATTN_THREADS), ("PS_TILE_N", ATTN_TILE_N), ("PS_PARTITION_SIZE", PARTITION_SIZE)),
            tuple(attention_kernel_name(d, bs, m) for d in ATTN_HEAD_DIMS for bs in ATTN_BLOCK_SIZES
                  for m in ATTN_BLOCK_MS) + tuple(attention_reduce_name(d) for d in ATTN_HEAD_DIMS),
        ),
        KernelModule("cache_ops", "cache_ops.cu", (), _typed("reshape_and_cache_kernel") + ("copy_blocks_kernel",)),
        KernelModule("norm", "norm.cu", (), _typed("add_rms_norm_kernel")),
        KernelModule("rotary", "rotary.cu", (), _typed("rotary_kernel")),
        KernelModule("activation", "activation.cu", (), _typed("silu_and_mul_kernel")),
        KernelModule("sampling", "sampling.cu", (), _typed("argmax_rows_kernel")),
    )
}
# Files that are not modules of their own: prepended to every module's source.
SHARED_SOURCES = ("common.cu",)


def is_cupy_array(x: Any) -> bool:
    """True for a CuPy ndarray, decided without importing CuPy."""
    return type(x).__module__.startswith("cupy")


# ---------------------------------------------------------------------------------------------
# Loading and launching
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


def _kernel(module: str, name: str):
    import cupy

    device = cupy.cuda.runtime.getDevice()
    key = (module, name, device)
    fn = _functions.get(key)
    if fn is None:
        mod = _modules.get((module, device))
        if mod is None:
            mod = _modules[(module, device)] = _load_module(MODULES[module])
        fn = _functions[key] = mod.get_function(name)
    return fn


def _storage_type(dtype, what: str) -> str:
    t = STORAGE_TYPES.get(np.dtype(dtype))
    if t is None:
        raise ValueError(f"{what}: dtype {np.dtype(dtype)} is not supported on the GPU (float16 or float32)")
    return t


def _elements(stride_bytes: int, itemsize: int, what: str) -> int:
    if stride_bytes % itemsize:
        raise ValueError(f"{what}: stride {stride_bytes} bytes is not a multiple of the item size")
    return stride_bytes // itemsize


def _inner_contiguous(x, what: str):
    """x with its last axis contiguous (a copy only when it is not)."""
    import cupy

    if x.ndim == 0:
        raise ValueError(f"{what}: expected an array with at least one axis")
    if x.strides[-1] != x.itemsize or any(s < 0 for s in x.strides):
        x = cupy.ascontiguousarray(x)
    return x


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _i32(x: int) -> np.int32:
    return np.int32(x)


def _i64(x: int) -> np.int64:
    return np.int64(x)


_dummies: dict[tuple[int, str], Any] = {}


def _dummy(dtype=np.float32):
    """A valid device pointer for kernel arguments that a launch does not use (one per device and dtype)."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), np.dtype(dtype).str)
    d = _dummies.get(key)
    if d is None:
        d = _dummies[key] = cupy.zeros(1, dtype=dtype)
    return d


# ---------------------------------------------------------------------------------------------
# ops.py counterparts
# ---------------------------------------------------------------------------------------------


def embedding(table, ids):
    """Rows of `table` [V, hidden] for `ids` [T] -> [T, hidden]."""
    import cupy

    if not is_cupy_array(ids):
        ids = np.asarray(ids)
        if ids.size and (int(ids.min()) < -table.shape[0] or int(ids.max()) >= table.shape[0]):
            bad = int(ids.max()) if int(ids.max()) >= table.shape[0] else int(ids.min())
            raise IndexError(f"index {bad} is out of bounds for axis 0 with size {table.shape[0]}")
        ids = cupy.asarray(ids)
    return cupy.take(table, ids, axis=0)


def linear(x, weight_t, bias=None, quant=None):
    """x [T, in] @ weight_t [in, out] -> [T, out]: cuBLAS, float32 accumulation for float16 operands.
    `quant` (host blocks of the same weight, ops.linear) is not used on the device.

    weight_t may be C- or F-contiguous (a tied lm_head is the embedding's transposed view); cuBLAS
    reads either layout in place.
    """
    out = x @ weight_t
    if bias is not None:
        out += bias
    return out


def pack_weight(w) -> None:
    """Matmul weights stay [in, out] arrays on the device (ops.pack_weight)."""
    return None


def _rows(a, hidden: int, what: str):
    """a as a 2-D [rows, hidden] array with contiguous rows (a view when it can be)."""
    import cupy

    a = _inner_contiguous(a, what)
    if a.ndim != 2:
        a = cupy.ascontiguousarray(a).reshape(-1, hidden)
    return a


def _norm(x, residual, weight, eps: float):
    import cupy

    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({hidden},)")
    if weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        raise ValueError("rms_norm: x, residual and weight must share one dtype on the GPU")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    t = _storage_type(x.dtype, "rms_norm")
    x2 = _rows(x, hidden, "rms_norm x")
    rows = x2.shape[0]
    normed = cupy.empty((rows, hidden), dtype=x.dtype)
    if residual is None:
        r_in = r_out = _dummy(x.dtype)
        r_stride = 0
    else:
        r_in = _rows(residual, hidden, "add_rms_norm residual")
        # In place, as the numpy op does, when the caller's array can take the result directly.
        in_place = r_in.data.ptr == residual.data.ptr and residual.flags.c_contiguous
        r_out = r_in if in_place else cupy.empty((rows, hidden), dtype=x.dtype)
        if not in_place:
            r_in = cupy.ascontiguousarray(r_in)
        r_stride = hidden
    if rows:
        # Threads depend on the hidden size only, so a row's reduction order never depends on the batch.
        threads = min(1024, max(64, _next_pow2(hidden) // 8))
        _kernel("norm", f"add_rms_norm_kernel<{t}>")(
            (rows,), (threads,),
            (normed, r_out, x2, _i64(_elements(x2.strides[0], x2.itemsize, "x")), r_in, _i64(r_stride),
             cupy.ascontiguousarray(weight), _i32(hidden), np.float32(eps), _i32(residual is not None)),
        )
    normed = normed.reshape(x.shape)
    if residual is None:
        return normed, x
    if r_out.data.ptr == residual.data.ptr:
        return normed, residual
    return normed, r_out.reshape(x.shape)


def rms_norm(x, weight, eps: float):
    """Root-mean-square norm over the last axis, computed in float32."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x, residual, weight, eps: float):
    """residual += x (in place, like the numpy op), then rms_norm(residual); returns (normed, residual).

    With no residual yet, `x` itself is returned as the residual.
    """
    return _norm(x, residual, weight, eps)


def rope_cos_sin(inv_freq, positions):
    """cos and sin [T, D/2] float32 of positions x inv_freq, computed in float64 on the device."""
    import cupy

    inv = cupy.asarray(inv_freq, dtype=cupy.float64)
    freqs = cupy.asarray(positions).astype(cupy.float64)[:, None] * inv[None, :]
    return cupy.cos(freqs).astype(cupy.float32), cupy.sin(freqs).astype(cupy.float32)


def apply_rotary(x, cos, sin):
    """Rotate x [T, heads, D] by position, rotate-half layout; returns a new contiguous array."""
    import cupy

    if x.ndim != 3 or x.shape[-1] % 2:
        raise ValueError(f"apply_rotary: x must be [T, heads, D] with even D, got shape {tuple(x.shape)}")
    t = _storage_type(x.dtype, "apply_rotary")
    tokens, heads, dim = x.shape
    half = dim // 2
    cos = cupy.ascontiguousarray(cupy.asarray(cos), dtype=cupy.float32)
    sin = cupy.ascontiguousarray(cupy.asarray(sin), dtype=cupy.float32)
    if cos.shape != (tokens, half) or sin.shape != (tokens, half):
        raise ValueError(f"apply_rotary: cos/sin must have shape ({tokens}, {half}), got {tuple(cos.shape)}")
    x = _inner_contiguous(x, "apply_rotary x")
    out = cupy.empty((tokens, heads, dim), dtype=x.dtype)
    if tokens:
        threads = min(256, max(32, -(-heads * half // 32) * 32))
        _kernel("rotary", f"rotary_kernel<{t}>")(
            (tokens,), (threads,),
            (out, x, _i64(_elements(x.strides[0], x.itemsize, "x")), _i64(_elements(x.strides[1], x.itemsize, "x")),
             cos, sin, _i32(heads), _i32(dim)),
        )
    return out


def silu_and_mul(x):
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    import cupy

    if x.ndim != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul: x must be [T, 2I], got shape {tuple(x.shape)}")
    t = _storage_type(x.dtype, "silu_and_mul")
    x = _inner_contiguous(x, "silu_and_mul x")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = cupy.empty((rows, inter), dtype=x.dtype)
    if rows and inter:
        threads = 256
        _kernel("activation", f"silu_and_mul_kernel<{t}>")(
            (rows, -(-inter // threads)), (threads,),
            (out, x, _i64(_elements(x.strides[0], x.itemsize, "x")), _i32(inter)),
        )
    return out


def logsumexp_rows(x, row_max=None):
    """ops.logsumexp_rows on the device (CuPy's reductions; the sampler's one pass over the logits)."""
    import cupy

    from ..reference import ops

    return ops.logsumexp_rows(x, row_max, cupy)


# ---------------------------------------------------------------------------------------------
# paged_attention.py counterparts
# ---------------------------------------------------------------------------------------------


def _check_cache_pair(k_cache, v_cache, what: str) -> None:
    if not (is_cupy_array(k_cache) and is_cupy_array(v_cache)):
        raise ValueError(f"{what}: k_cache and v_cache must be CuPy arrays")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{what}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         "[num_blocks, block_size, num_kv_heads, head_dim] with one dtype")
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError(f"{what}: KV caches must be C-contiguous")


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write key/value [T, KV, D] into the caches at `slot_mapping` [T]; slot -1 means skip."""
    import cupy

    _check_cache_pair(k_cache, v_cache, "reshape_and_cache")
    num_blocks, block_size, num_kv, dim = k_cache.shape
    num_slots = num_blocks * block_size
    if key.ndim != 3 or key.shape != value.shape or tuple(key.shape[1:]) != (num_kv, dim):
        raise ValueError(f"reshape_and_cache: key/value must be [T, {num_kv}, {dim}], got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        raise ValueError("reshape_and_cache: key/value dtype must match the cache dtype")
    t = _storage_type(k_cache.dtype, "reshape_and_cache")
    tokens = key.shape[0]
    if len(slot_mapping) != tokens:
        raise ValueError(f"reshape_and_cache: slot_mapping has {len(slot_mapping)} entries for {tokens} tokens")
    if is_cupy_array(slot_mapping):
        slots = cupy.ascontiguousarray(slot_mapping, dtype=cupy.int64)
    else:
        host = np.ascontiguousarray(slot_mapping, dtype=np.int64)
        kept = host[host >= 0]
        if kept.size and int(kept.max()) >= num_slots:
            raise IndexError(f"slot {int(kept.max())} is outside a cache of {num_slots} slots")
        slots = cupy.asarray(host)
    if not tokens:
        return
    key = _inner_contiguous(key, "key")
    value = _inner_contiguous(value, "value")
    n = num_kv * dim
    threads = min(256, max(32, -(-n // 32) * 32))
    _kernel("cache_ops", f"reshape_and_cache_kernel<{t}>")(
        (tokens,), (threads,),
        (key, value, _i64(_elements(key.strides[0], key.itemsize, "key")),
         _i64(_elements(key.strides[1], key.itemsize, "key")),
         _i64(_elements(value.strides[0], value.itemsize, "value")),
         _i64(_elements(value.strides[1], value.itemsize, "value")),
         k_cache, v_cache, slots, _i64(num_slots), _i32(num_kv), _i32(dim)),
    )


def rotary_and_cache(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping):
    """paged_attention.rotary_and_cache: apply_rotary and reshape_and_cache on qkv's head views, each its own
    kernel here (a launch costs microseconds, not the CPU's cold-cache call)."""
    from ..reference.paged_attention import compose_rotary_and_cache

    return compose_rotary_and_cache(apply_rotary, reshape_and_cache, qkv, num_heads, num_kv_heads, cos, sin,
                                    k_cache, v_cache, slot_mapping)


def copy_blocks(kv_caches, block_mapping) -> None:
    """Copy whole blocks src -> dst in every layer's K and V, with numpy's semantics: every source is
    read before any destination is written (kv_cache_manager.take_pending_copies documents a block
    that is a source and, after a preemption freed it, a later copy's destination in the same step).

    The caches' base addresses go to the kernel as one array of pointers, so the launch count does
    not grow with the number of layers. The copies of one launch run concurrently, so when a block is
    both a source and a destination the copy goes through a scratch buffer in two launches (gather,
    then scatter); otherwise it is one direct launch. Destinations must be distinct (the KV manager
    guarantees it; which of two writes to one block wins would be up to the GPU's scheduling).
    """
    import cupy

    if not block_mapping:
        return
    caches = [c for pair in kv_caches for c in pair]
    first = caches[0]
    for c in caches:
        if not is_cupy_array(c) or c.shape != first.shape or c.dtype != first.dtype or not c.flags.c_contiguous:
            raise ValueError("copy_blocks: every K and V cache must be a C-contiguous CuPy array"
                             " of one shape and dtype")
    mapping = np.asarray(block_mapping, dtype=np.int64).reshape(-1, 2)
    num_blocks = first.shape[0]
    if int(mapping.min()) < 0 or int(mapping.max()) >= num_blocks:
        raise IndexError(f"copy_blocks: block id outside [0, {num_blocks})")
    src, dst = mapping[:, 0], mapping[:, 1]
    if len(np.unique(dst)) != len(dst):
        raise ValueError("copy_blocks: a destination block appears twice in one call")
    ptrs = cupy.asarray(np.array([c.data.ptr for c in caches], dtype=np.uint64))
    block_bytes = int(np.prod(first.shape[1:])) * first.itemsize
    grid, kernel, device_mapping = (len(mapping), len(caches)), _kernel("cache_ops", "copy_blocks_kernel"), \
        cupy.asarray(mapping)
    if not np.intersect1d(src, dst).size:
        kernel(grid, (256,), (ptrs, device_mapping, _i64(block_bytes), _dummy(np.uint8), _i32(0)))
        return
    scratch = cupy.empty(len(mapping) * len(caches) * block_bytes, dtype=cupy.uint8)
    for phase in (1, 2):  # same stream: the scatter starts after every source has been read
        kernel(grid, (256,), (ptrs, device_mapping, _i64(block_bytes), scratch, _i32(phase)))


@dataclass(frozen=True)
class AttentionLaunch:
    """How one paged attention call is cut into CTAs (see paged_attention.cu)."""

    block_m: int  # rows per CTA: query tokens x query heads of one kv head
    block_q: int  # query tokens per CTA
    num_tiles: int  # grid.x: an upper bound on the query tiles, from T and B only


def attention_launch(num_heads: int, num_kv_heads: int, num_tokens: int, num_seqs: int) -> AttentionLaunch:
    """Tile shape for a batch. Decode-only batches (T == B) use the smallest row tile that holds a
    query-head group; anything with a prefill chunk uses 16+ rows. Which one is picked never changes
    a row's result (the kernel's per-row arithmetic does not depend on it)."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"paged_attention: {num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    if group > MAX_QUERIES_PER_KV:
        raise ValueError(f"paged_attention: {group} query heads per kv head; the GPU kernel supports at most "
                         f"{MAX_QUERIES_PER_KV}")
    block_m = max(4, _next_pow2(group))
    if num_tokens != num_seqs:
        block_m = max(16, block_m)
    block_q = block_m // group
    return AttentionLaunch(block_m, block_q, (num_tokens - num_seqs) // block_q + num_seqs)


def _check_host_metadata(query_start_loc, seq_lens, block_tables, num_tokens: int, block_size: int,
                         num_blocks: int) -> int:
    """Validate host-side batch metadata; returns max(seq_lens)."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    tables = np.asarray(block_tables)
    b = lens.shape[0]
    if qsl.shape != (b + 1,) or qsl[0] != 0 or qsl[-1] != num_tokens:
        raise ValueError(f"paged_attention: query_start_loc must be [{b + 1}] from 0 to {num_tokens},"
                         f" got {qsl.tolist()}")
    num_new = np.diff(qsl)
    if (num_new < 1).any():
        raise ValueError("paged_attention: every sequence needs at least one query token")
    if (lens < num_new).any():
        raise ValueError("paged_attention: a sequence has more query tokens than its seq_len")
    if tables.ndim != 2 or tables.shape[0] != b:
        raise ValueError(f"paged_attention: block_tables must be [{b}, max_blocks], got {tuple(tables.shape)}")
    needed = -(-lens // block_size)
    if int(needed.max()) > tables.shape[1]:
        raise ValueError(f"paged_attention: a sequence needs {int(needed.max())} blocks, block_tables has "
                         f"{tables.shape[1]} columns")
    used = tables[np.arange(tables.shape[1])[None, :] < needed[:, None]]
    if used.size and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise IndexError(f"paged_attention: block id outside [0, {num_blocks}) in block_tables")
    return int(lens.max())


def _device_int32(a):
    import cupy

    if is_cupy_array(a):
        return cupy.ascontiguousarray(a, dtype=cupy.int32)
    return cupy.asarray(np.ascontiguousarray(a, dtype=np.int32))


def plan_attention(query_shape, cache_shape, query_start_loc, seq_lens, block_tables) -> None:
    """None: the GPU step's metadata is checked and uploaded once already (models/device_batch.to_device)."""
    return None


def paged_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float, plan=None):
    """Unified paged attention over a flat varlen batch: query [T, H, D] float16 -> out [T, H, D]. `plan` is
    plan_attention's None (accepted for the op table's one signature).

    One launch of paged_attention_kernel covers prefill chunks and decodes; decodes longer than
    PARTITION_SIZE are split into partitions and combined by a second, small reduce launch.
    """
    import cupy

    _check_cache_pair(k_cache, v_cache, "paged_attention")
    num_blocks, block_size, num_kv, dim = k_cache.shape
    if query.ndim != 3 or query.shape[2] != dim:
        raise ValueError(f"paged_attention: query must be [T, H, {dim}], got {tuple(query.shape)}")
    if query.dtype != np.float16 or k_cache.dtype != np.float16:
        raise ValueError("paged_attention: the GPU kernel takes float16 query and caches")
    if dim not in ATTN_HEAD_DIMS:
        raise ValueError(f"paged_attention: head_dim {dim} is not supported on the GPU ({ATTN_HEAD_DIMS})")
    if block_size not in ATTN_BLOCK_SIZES:
        raise ValueError(f"paged_attention: block_size {block_size} is not supported on the GPU ({ATTN_BLOCK_SIZES})")
    if k_cache.data.ptr % 16 or v_cache.data.ptr % 16:
        raise ValueError("paged_attention: KV caches must be 16-byte aligned")
    num_tokens, num_heads, _ = query.shape
    num_seqs = int(seq_lens.shape[0])
    launch = attention_launch(num_heads, num_kv, num_tokens, num_seqs)
    out = cupy.empty((num_tokens, num_heads, dim), dtype=cupy.float16)
    if num_tokens == 0:
        return out
    if is_cupy_array(seq_lens) or is_cupy_array(query_start_loc) or is_cupy_array(block_tables):
        max_seq_len = int(block_tables.shape[1]) * block_size  # a bound; reading the real one would sync
    else:
        max_seq_len = _check_host_metadata(query_start_loc, seq_lens, block_tables, num_tokens, block_size,
                                           num_blocks)
    qsl = _device_int32(query_start_loc)
    lens = _device_int32(seq_lens)
    tables = _device_int32(block_tables)
    max_parts = max(1, math.ceil(max_seq_len / PARTITION_SIZE))
    chunk = partition_chunk(num_seqs, num_heads, dim, max_parts)
    if max_parts > 1:
        part_acc = cupy.empty((chunk, num_heads, max_parts, dim), dtype=cupy.float32)
        part_ml = cupy.empty((chunk, num_heads, max_parts, 2), dtype=cupy.float32)
    else:
        part_acc = part_ml = _dummy()
    query = _inner_contiguous(query, "query")
    attend = _kernel("paged_attention", attention_kernel_name(dim, block_size, launch.block_m))
    reduce = _kernel("paged_attention", attention_reduce_name(dim)) if max_parts > 1 else None
    for begin in range(0, num_seqs, chunk):  # one range, unless the partials would exceed the cap
        end = min(num_seqs, begin + chunk)
        attend(
            (launch.num_tiles, num_kv, max_parts), (ATTN_THREADS,),
            (out, part_acc, part_ml, query, _i64(_elements(query.strides[0], 2, "query")),
             _i64(_elements(query.strides[1], 2, "query")), k_cache, v_cache, qsl, lens, tables,
             _i64(tables.shape[1]), _i32(num_seqs), _i32(num_heads), _i32(num_kv), _i32(launch.block_q),
             _i32(max_parts), np.float32(scale * LOG2E), _i32(begin), _i32(end)),
        )
        if reduce is not None:
            reduce((end - begin, num_heads), (dim,),
                   (out, part_acc, part_ml, qsl, lens, _i32(num_heads), _i32(max_parts), _i32(begin)))
    return out


def partition_bytes_per_seq(num_heads: int, head_dim: int, max_parts: int) -> int:
    """float32 partials (acc [D] + max and sum) of one sequence split into max_parts partitions."""
    return num_heads * max_parts * (head_dim + 2) * 4 if max_parts > 1 else 0


def partition_chunk(num_seqs: int, num_heads: int, head_dim: int, max_parts: int) -> int:
    """Sequences per attention launch: all of them unless their partials exceed PARTITION_SCRATCH_BYTES."""
    per_seq = partition_bytes_per_seq(num_heads, head_dim, max_parts)
    if per_seq == 0 or num_seqs == 0:
        return max(1, num_seqs)
    return max(1, min(num_seqs, PARTITION_SCRATCH_BYTES // per_seq))


# ---------------------------------------------------------------------------------------------
# Sampling helpers (not dispatched from the op layer: the runtime's sampler is backend-generic)
# ---------------------------------------------------------------------------------------------


def argmax_rows(logits):
    """Index of the largest value of each row of logits [B, V] -> int64 [B], numpy.argmax's ties/NaN rule."""
    import cupy

    if logits.ndim != 2:
        raise ValueError(f"argmax_rows: logits must be [B, V], got shape {tuple(logits.shape)}")
    t = _storage_type(logits.dtype, "argmax_rows")
    logits = _inner_contiguous(logits, "logits")
    rows, vocab = logits.shape
    out = cupy.empty(rows, dtype=cupy.int64)
    if rows and vocab:
        _kernel("sampling", f"argmax_rows_kernel<{t}>")(
            (rows,), (1024,), (out, logits, _i64(_elements(logits.strides[0], logits.itemsize, "logits")),
                               _i32(vocab)),
        )
    elif rows:
        raise ValueError("argmax_rows: attempt to get argmax of an empty row")
    return out
