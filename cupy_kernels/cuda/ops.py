"""CUDA implementations of the op layer, for CuPy arrays.

Every function here has the signature of its numpy reference in ops.py / paged_attention.py; the CUDA
backend's op table (kernel_set.cuda_kernels) holds them. CuPy is imported inside the functions only, so importing
this module (and with it pagedserve.cupy_kernels) never needs CuPy or a GPU. The kernels they launch, and how
they are compiled: modules.py; the paged attention op and its launch planning: attention.py.

Embedding and linear use CuPy directly: `cupy.take` and `x @ weight_t`. For float16 operands CuPy's
matmul calls cublasGemmEx with compute type CUBLAS_COMPUTE_32F and tensor-op algorithms
(cupy/_core/_routines_linalg.pyx, tensordot_core_v11): float16 storage, float32 accumulation, one
rounding of the result to float16. cupy's COMPUTE_TYPE_FP16 setting is not honoured by that path,
so no global state can make it accumulate in float16 behind our back.

Host metadata. A numpy slot_mapping is checked on the host (batch_checks.check_slot_mapping) and uploaded; as a
CuPy array it is used as it is, without a device sync, and slots outside the cache are skipped silently.
"""

from __future__ import annotations

import numpy as np

from ..batch_checks import check_slot_mapping
from .attention import kv_element_type, paged_attention, plan_attention  # noqa: F401 - the op table's
from .launch import _check_cache_pair, _dummy, _elements, _i32, _i64, _inner_contiguous, _next_pow2, _storage_type
from . import cublas_route
from .modules import _kernel

# Read from here by the runtime, tests and benchmarks: the module table, the attention's launch planning.
from .attention import (PARTITION_SCRATCH_BYTES, AttentionLaunch, _check_host_metadata,  # noqa: F401
                        attention_launch, partition_bytes_per_seq, partition_chunk)
from .launch import is_cupy_array  # noqa: F401
from .modules import (ATTN_BLOCK_MS, ATTN_BLOCK_SIZES, ATTN_HEAD_DIMS, ATTN_THREADS, ATTN_TILE_N,  # noqa: F401
                      CUPY_IMPLICIT_OPTIONS, KERNEL_DIR, LOG2E, MAX_QUERIES_PER_KV, MODULES, NVRTC_OPTIONS,
                      PARTITION_SIZE, SHARED_SOURCES, STORAGE_TYPES, KernelModule, attention_kernel_name,
                      attention_module_name, attention_reduce_name, family_name_expressions)


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
    reads either layout in place. The GEMM is our own cuBLAS handle's when cublas_route.py's probe found
    one that a stream capture records (CuPy's refuses), else CuPy's matmul.
    """
    gemm = cublas_route.current_gemm() if x.ndim == 2 and weight_t.ndim == 2 else None
    out = x @ weight_t if gemm is None else gemm.matmul(x, weight_t)
    if bias is not None:
        out += bias
    return out


def pack_weight(w, gated: bool = False) -> None:
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


def linear_silu_and_mul(x, weight_t, quant=None):
    """ops.linear_silu_and_mul: the GEMM, then the SiLU-and-mul kernel."""
    return silu_and_mul(linear(x, weight_t, quant=quant))


def logsumexp_rows(x, row_max=None):
    """ops.logsumexp_rows on the device (CuPy's reductions; the sampler's one pass over the logits)."""
    import cupy

    from ..reference import ops

    return ops.logsumexp_rows(x, row_max, cupy)


# ---------------------------------------------------------------------------------------------
# paged_attention.py counterparts
# ---------------------------------------------------------------------------------------------



def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, kv_cache_dtype: str | None = None) -> None:
    """Write key/value [T, KV, D] into the caches at `slot_mapping` [T]; slot -1 means skip. Caches of the keys'
    dtype, or for float16 keys bfloat16 or fp8 caches (kv_cache_dtype, read from the caches' dtype when None:
    attention.kv_element_type), converted as they are written (kv_types.cuh; fp8 rows: D codes, then the scale)."""
    import cupy

    _check_cache_pair(k_cache, v_cache, "reshape_and_cache")
    num_blocks, block_size, num_kv, dim = k_cache.shape
    num_slots = num_blocks * block_size
    kv = None  # the caches' element type when it is not the keys'
    if kv_cache_dtype is not None or (key.dtype != k_cache.dtype and key.dtype == np.float16):
        kv = kv_element_type(k_cache.dtype, kv_cache_dtype, "reshape_and_cache")
        kv = None if kv == "f16" else kv
        dim -= 4 if kv is not None and kv.startswith("kv_fp8") else 0
    if key.ndim != 3 or key.shape != value.shape or tuple(key.shape[1:]) != (num_kv, dim):
        raise ValueError(f"reshape_and_cache: key/value must be [T, {num_kv}, {dim}], got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    if (key.dtype != k_cache.dtype and kv is None) or value.dtype != key.dtype or (kv and key.dtype != np.float16):
        raise ValueError("reshape_and_cache: key/value dtype must match the cache dtype")
    t = _storage_type(key.dtype, "reshape_and_cache")
    tokens = key.shape[0]
    if len(slot_mapping) != tokens:
        raise ValueError(f"reshape_and_cache: slot_mapping has {len(slot_mapping)} entries for {tokens} tokens")
    if is_cupy_array(slot_mapping):
        slots = cupy.ascontiguousarray(slot_mapping, dtype=cupy.int64)
    else:
        host = np.ascontiguousarray(slot_mapping, dtype=np.int64)
        check_slot_mapping(host, num_slots, "reshape_and_cache")
        slots = cupy.asarray(host)
    if not tokens:
        return
    key = _inner_contiguous(key, "key")
    value = _inner_contiguous(value, "value")
    n = num_kv * dim
    threads = min(256, max(32, -(-n // 32) * 32))
    grid = (tokens,) if kv is None else (tokens, num_kv)  # the converting kernel: a warp a (token, kv head) row
    name = f"reshape_and_cache_kernel<{t}>" if kv is None else f"reshape_and_cache_kv_kernel<{t}, {kv}>"
    _kernel("cache_ops", name)(
        grid, (threads,) if kv is None else (32,),
        (key, value, _i64(_elements(key.strides[0], key.itemsize, "key")),
         _i64(_elements(key.strides[1], key.itemsize, "key")),
         _i64(_elements(value.strides[0], value.itemsize, "value")),
         _i64(_elements(value.strides[1], value.itemsize, "value")),
         k_cache, v_cache, slots, _i64(num_slots), _i32(num_kv), _i32(dim)),
    )


def rotary_and_cache(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping,
                     kv_cache_dtype: str | None = None):
    """paged_attention.rotary_and_cache: apply_rotary and reshape_and_cache on qkv's head views, each its own
    kernel here (a launch costs microseconds, not the CPU's cold-cache call). kv_cache_dtype: reshape_and_cache's."""
    from ..reference.paged_attention import compose_rotary_and_cache

    def write(key, value, k, v, slots):
        reshape_and_cache(key, value, k, v, slots, kv_cache_dtype)

    return compose_rotary_and_cache(apply_rotary, write, qkv, num_heads, num_kv_heads, cos, sin,
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


SAMPLE_THREADS = 512  # PS_SAMPLE_THREADS in sampling.cu: the most threads a sample_rows launch uses


def sample_rows(logits, temperature, top_k, top_p, min_p, uniforms, by_value=None, out=None):
    """One token id per row of logits [B, V] (float16/32): logits / temperature, then top-k, top-p, min-p,
    then an inverse-CDF draw in token order with the row's uniform; no sort (sampling.cu's sample_rows_kernel;
    numpy reference: reference/sample_rows.py). Per-row parameters: temperature (> 0) float32, top_k int32
    (0 = off), top_p float32 (1 = off), min_p float32 (0 = off), uniforms float64 in [0, 1), by_value int32 (1:
    draw in value order, the host sampler's order for top-k rows; None: token order for every row): each [B], on
    the host or the device. Returns int64 [B] (into `out` when given: a graph's static buffer)."""
    import cupy

    if logits.ndim != 2:
        raise ValueError(f"sample_rows: logits must be [B, V], got shape {tuple(logits.shape)}")
    t = _storage_type(logits.dtype, "sample_rows")
    logits = _inner_contiguous(logits, "logits")
    rows, vocab = logits.shape
    if rows and not vocab:
        raise ValueError("sample_rows: logits has rows of length 0")
    args = []
    for name, a, dtype in (("temperature", temperature, np.float32), ("top_k", top_k, np.int32),
                           ("top_p", top_p, np.float32), ("min_p", min_p, np.float32),
                           ("uniforms", uniforms, np.float64),
                           ("by_value", np.zeros(rows, np.int32) if by_value is None else by_value, np.int32)):
        if not is_cupy_array(a):
            a = np.ascontiguousarray(a, dtype=dtype)
        if a.shape != (rows,):
            raise ValueError(f"sample_rows: {name} has shape {tuple(a.shape)}, expected ({rows},)")
        if a.dtype != dtype or not a.flags.c_contiguous:
            raise ValueError(f"sample_rows: {name} must be a contiguous {np.dtype(dtype).name} array")
        args.append(a if is_cupy_array(a) else cupy.asarray(a))
    if out is None:
        out = cupy.empty(rows, dtype=cupy.int64)
    elif out.shape != (rows,) or out.dtype != np.int64:
        raise ValueError(f"sample_rows: out must be int64 ({rows},)")
    if rows:
        threads = min(SAMPLE_THREADS, max(32, _next_pow2(-(-vocab // 8))))
        _kernel("sampling", f"sample_rows_kernel<{t}>")(
            (rows,), (threads,),
            (out, logits, _i64(_elements(logits.strides[0], logits.itemsize, "logits")), _i32(vocab), *args),
        )
    return out
