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
# The sampling helpers (not dispatched from the op layer: the runtime's sampler is backend-generic).
from .sampling import SAMPLE_THREADS, argmax_rows, sample_rows  # noqa: F401

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


def embedding(table, ids, out=None):
    """Rows of `table` [V, hidden] for `ids` [T] -> [T, hidden] (into `out` when given: a workspace's buffer).
    Host ids are checked (negative ones count from the end, as numpy's); device ids are trusted metadata."""
    import cupy

    if not is_cupy_array(ids):
        ids = np.asarray(ids)
        if ids.size and (int(ids.min()) < -table.shape[0] or int(ids.max()) >= table.shape[0]):
            bad = int(ids.max()) if int(ids.max()) >= table.shape[0] else int(ids.min())
            raise IndexError(f"index {bad} is out of bounds for axis 0 with size {table.shape[0]}")
        ids = cupy.asarray(np.where(ids < 0, ids + table.shape[0], ids).astype(np.int64))
    elif ids.dtype != np.int64:
        ids = ids.astype(cupy.int64)
    if table.ndim != 2 or ids.ndim != 1:
        raise ValueError(f"embedding: table must be [V, hidden] and ids [T], got {tuple(table.shape)} and "
                         f"{tuple(ids.shape)}")
    t = _storage_type(table.dtype, "embedding")
    table = _inner_contiguous(table, "embedding table")
    tokens, hidden = ids.shape[0], table.shape[1]
    out = _out(out, (tokens, hidden), table.dtype, "embedding")
    if tokens and hidden:
        _kernel("embedding", f"embedding_kernel<{t}>")(
            (tokens,), (min(1024, max(32, -(-hidden // 4 // 32) * 32)),),
            (out, table, _i64(_elements(table.strides[0], table.itemsize, "table")), ids, _i32(hidden)))
    return out


def _out(out, shape, dtype, what: str):
    """`out` checked against what an op writes (a C-contiguous `shape` of `dtype`), or a new array."""
    import cupy

    if out is None:
        return cupy.empty(shape, dtype=dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype != np.dtype(dtype) or not out.flags.c_contiguous:
        raise ValueError(f"{what}: out must be a C-contiguous {np.dtype(dtype)} array of {tuple(shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    return out


def _scratch(workspace, name: str, shape, dtype):
    """An op's own temporary: the workspace's buffer `name` (a decode graph's), or a new array."""
    import cupy

    return cupy.empty(shape, dtype=dtype) if workspace is None else workspace.take(name, tuple(shape), dtype)


def linear(x, weight_t, bias=None, quant=None, out=None, workspace=None):
    """x [T, in] @ weight_t [in, out] -> [T, out]: cuBLAS, float32 accumulation for float16 operands.
    `quant` (host blocks of the same weight, ops.linear) is not used on the device. `out`: where the product goes
    (a workspace's buffer); a float32 `out` for float16 operands takes the product rounded to float16 and widened
    (the logits: to_float32_kernel from a `workspace` buffer, no astype).

    weight_t may be C- or F-contiguous (a tied lm_head is the embedding's transposed view); cuBLAS
    reads either layout in place. The GEMM is our own cuBLAS handle's when cublas_route.py's probe found
    one that a stream capture records (CuPy's refuses), else CuPy's matmul.
    """
    wide = out is not None and out.dtype == np.float32 and x.dtype != np.float32
    if wide:
        final, out = out, _scratch(workspace, "linear_storage", tuple(out.shape), x.dtype)
    gemm = cublas_route.current_gemm() if x.ndim == 2 and weight_t.ndim == 2 else None
    if gemm is not None:
        out = gemm.matmul(x, weight_t, out=out)
    elif out is None:
        out = x @ weight_t
    else:
        import cupy

        out = cupy.matmul(x, weight_t, out=out)
    if bias is not None:
        out += bias
    return to_float32(out, final) if wide else out


def to_float32(x, out=None):
    """x [T, N] (float16 or float32) widened to float32 [T, N], into `out` when given."""
    import cupy

    if x.ndim != 2:
        raise ValueError(f"to_float32: x must be [T, N], got shape {tuple(x.shape)}")
    t = _storage_type(x.dtype, "to_float32")
    x = _inner_contiguous(x, "to_float32 x")
    rows, n = x.shape
    out = _out(out, (rows, n), cupy.float32, "to_float32")
    if rows and n:
        _kernel("activation", f"to_float32_kernel<{t}>")(
            (rows, -(-n // 256)), (256,), (out, x, _i64(_elements(x.strides[0], x.itemsize, "x")), _i32(n)))
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


def _norm(x, residual, weight, eps: float, out=None):
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
    normed = _out(None if out is None else out.reshape(rows, hidden), (rows, hidden), x.dtype, "rms_norm")
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


def rms_norm(x, weight, eps: float, out=None):
    """Root-mean-square norm over the last axis, computed in float32 (into `out`, x's shape, when given)."""
    return _norm(x, None, weight, eps, out)[0]


def add_rms_norm(x, residual, weight, eps: float, out=None):
    """residual += x (in place, like the numpy op), then rms_norm(residual); returns (normed, residual).

    With no residual yet, `x` itself is returned as the residual. `out`: where normed goes (x's shape).
    """
    return _norm(x, residual, weight, eps, out)


def rope_cos_sin(inv_freq, positions, out=None):
    """cos and sin [T, D/2] float32 of positions x inv_freq, computed in float64 on the device (rope_cos_sin_kernel;
    into the pair `out` when given)."""
    import cupy

    inv = cupy.ascontiguousarray(cupy.asarray(inv_freq, dtype=cupy.float64))
    pos = cupy.ascontiguousarray(cupy.asarray(positions, dtype=cupy.int64))
    if inv.ndim != 1 or pos.ndim != 1:
        raise ValueError(f"rope_cos_sin: inv_freq and positions must be 1-D, got {tuple(inv.shape)} and "
                         f"{tuple(pos.shape)}")
    shape = (pos.shape[0], inv.shape[0])
    cos, sin = (None, None) if out is None else out
    cos, sin = _out(cos, shape, cupy.float32, "rope_cos_sin cos"), _out(sin, shape, cupy.float32, "rope_cos_sin sin")
    if shape[0] and shape[1]:
        _kernel("rotary", "rope_cos_sin_kernel")((shape[0],), (min(256, max(32, -(-shape[1] // 32) * 32)),),
                                                 (cos, sin, pos, inv, _i32(shape[1])))
    return cos, sin


def apply_rotary(x, cos, sin, out=None):
    """Rotate x [T, heads, D] by position, rotate-half layout; returns a new contiguous array (or `out`)."""
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
    out = _out(out, (tokens, heads, dim), x.dtype, "apply_rotary")
    if tokens:
        threads = min(256, max(32, -(-heads * half // 32) * 32))
        _kernel("rotary", f"rotary_kernel<{t}>")(
            (tokens,), (threads,),
            (out, x, _i64(_elements(x.strides[0], x.itemsize, "x")), _i64(_elements(x.strides[1], x.itemsize, "x")),
             cos, sin, _i32(heads), _i32(dim)),
        )
    return out


def silu_and_mul(x, out=None):
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I] (into `out` when given)."""

    if x.ndim != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul: x must be [T, 2I], got shape {tuple(x.shape)}")
    t = _storage_type(x.dtype, "silu_and_mul")
    x = _inner_contiguous(x, "silu_and_mul x")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = _out(out, (rows, inter), x.dtype, "silu_and_mul")
    if rows and inter:
        threads = 256
        _kernel("activation", f"silu_and_mul_kernel<{t}>")(
            (rows, -(-inter // threads)), (threads,),
            (out, x, _i64(_elements(x.strides[0], x.itemsize, "x")), _i32(inter)),
        )
    return out


def linear_silu_and_mul(x, weight_t, quant=None, out=None, workspace=None):
    """ops.linear_silu_and_mul: the GEMM (into the workspace's gate_up buffer, when given), then the SiLU-and-mul
    kernel (into `out`)."""
    gate_up = None if workspace is None else workspace.take("gate_up", (x.shape[0], weight_t.shape[1]), x.dtype)
    return silu_and_mul(linear(x, weight_t, quant=quant, out=gate_up), out=out)


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
                     kv_cache_dtype: str | None = None, out=None, workspace=None):
    """paged_attention.rotary_and_cache: apply_rotary and reshape_and_cache on qkv's head views, each its own
    kernel here (a launch costs microseconds, not the CPU's cold-cache call). kv_cache_dtype: reshape_and_cache's.
    `out`: the rotated query's buffer; `workspace`: the rotated key's (written to the cache, then dead)."""
    from ..reference.paged_attention import compose_rotary_and_cache

    def rotate(x, c, s):  # the key first, then the query (compose_rotary_and_cache's order)
        if x.shape[1] == num_heads and x.data.ptr == qkv.data.ptr:
            return apply_rotary(x, c, s, out=out)
        return apply_rotary(x, c, s, out=None if workspace is None else
                            workspace.take("rotary_key", tuple(x.shape), x.dtype))

    def write(key, value, k, v, slots):
        reshape_and_cache(key, value, k, v, slots, kv_cache_dtype)

    return compose_rotary_and_cache(rotate, write, qkv, num_heads, num_kv_heads, cos, sin,
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
