"""The CUDA paged attention op: how a batch is cut into CTAs and launches (attention_launch, partition_chunk),
and the launches themselves (paged_attention).

Tensor-core prefill (prefill_attention.cu, issue #45): with PAGEDSERVE_TC_PREFILL=1 on an sm_80+ device, the rows
of sequences with two or more new tokens go to prefill_attention_kernel (mma.sync m16n8k16) and the decodes to
paged_attention_kernel, two launches. Off by default until a device run has shown it correct and faster;
prefill_attention() is also callable alone (float16 or bfloat16, head dims 64/128/256).

Host metadata. When query_start_loc / seq_lens / block_tables arrive as numpy arrays they are checked on the
host (batch_checks.check_metadata: sizes, ranges, block ids) and uploaded. As CuPy arrays they are used as
they are, without a device sync: the attention then sizes its partition workspace from block_tables.shape[1]
instead of max(seq_lens).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from ..batch_checks import check_metadata
from ..reference.paged_attention import check_sliding_window
from .launch import _check_cache_pair, _dummy, _elements, _i32, _i64, _inner_contiguous, _next_pow2, is_cupy_array
from .modules import (ATTN_BLOCK_SIZES, ATTN_HEAD_DIMS, ATTN_KV_TYPES, ATTN_THREADS, FP8_BLOCK_MS, KV_TYPES, LOG2E,
                      MAX_QUERIES_PER_KV, PARTITION_SIZE, PREFILL_BLOCK_Q, PREFILL_HEAD_DIMS, PREFILL_THREADS, _kernel,
                      attention_kernel_name, attention_reduce_name, attention_shared_bytes, prefill_kernel_name)

# Most bytes of float32 partials (acc + max/sum) one attention launch may use. A batch whose split
# decodes would need more runs in several launches over ranges of sequences (each with this much at
# most), so 256 sequences at 131,072 tokens (1 GiB of partials in one launch) cost 64 MiB, not 1 GiB.
PARTITION_SCRATCH_BYTES = 64 << 20

# "1": prefill chunks on tensor cores (sm_80+ only). Default off until a device run proves it (issue #45).
TC_PREFILL_ENV = "PAGEDSERVE_TC_PREFILL"


_capabilities: dict[int, int] = {}


def _compute_capability() -> int:
    """The current device's compute capability as an int (90 for sm_90), looked up once per device."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    if device not in _capabilities:
        _capabilities[device] = int(cupy.cuda.Device(device).compute_capability)
    return _capabilities[device]


def tensor_core_prefill_enabled() -> bool:
    """PAGEDSERVE_TC_PREFILL=1 and an sm_80+ device (mma.sync m16n8k16 with bf16 needs sm_80)."""
    return os.environ.get(TC_PREFILL_ENV, "0") == "1" and _compute_capability() >= 80


def _storage_kind(dtype, what: str) -> str:
    """The attention kernels' storage type T: float16 -> "f16"; bfloat16 (ml_dtypes' type, or uint16 arrays holding
    bfloat16 bits: CuPy has no bfloat16 dtype) -> "bf16"."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return "f16"
    if dtype == np.uint16 or dtype.name == "bfloat16":
        return "bf16"
    raise ValueError(f"{what}: dtype {dtype} is not float16 or bfloat16")


def kv_element_type(cache_dtype, kv_cache_dtype: str | None, what: str) -> str:
    """The caches' C++ element type (modules.KV_TYPES, kv_types.cuh): `kv_cache_dtype` when given (an fp8 cache is a
    uint8 array: CuPy has no fp8 dtype), else read from the array's dtype (float16; uint16: bfloat16's bits;
    ml_dtypes' fp8 types, in the host emulation)."""
    dtype = np.dtype(cache_dtype)
    if kv_cache_dtype is None:
        inferred = {"float16": "float16", "uint16": "bfloat16", "bfloat16": "bfloat16", "float8_e4m3fn": "fp8_e4m3",
                    "float8_e5m2": "fp8_e5m2"}.get(dtype.name)
        if inferred is None:
            raise ValueError(f"{what}: a cache of {dtype} needs kv_cache_dtype (one of {', '.join(KV_TYPES)})")
        kv_cache_dtype = inferred
    if kv_cache_dtype not in KV_TYPES:
        raise ValueError(f"{what}: kv_cache_dtype {kv_cache_dtype!r} has no CUDA kernels; choose one of "
                         f"{', '.join(KV_TYPES)}")
    kind = KV_TYPES[kv_cache_dtype]
    if dtype.itemsize != (1 if kind.startswith("kv_fp8") else 2):
        raise ValueError(f"{what}: a {kv_cache_dtype} cache cannot be an array of {dtype}")
    return kind


@dataclass(frozen=True)
class AttentionLaunch:
    """How one paged attention call is cut into CTAs (see paged_attention.cu)."""

    block_m: int  # rows per CTA: query tokens x query heads of one kv head
    block_q: int  # query tokens per CTA
    num_tiles: int  # grid.x: an upper bound on the query tiles, from T and B only



def _check_inputs(name: str, query, k_cache, v_cache, head_dims: tuple[int, ...], kv_cache_dtype: str | None = None
                  ) -> tuple[str, str]:
    """The checks both attention kernels make of their arrays; the storage kind (_storage_kind) and the caches'
    element type (kv_element_type: the query's kind, or one of ATTN_KV_TYPES for a float16 query)."""
    _check_cache_pair(k_cache, v_cache, name)
    _, block_size, _, dim = k_cache.shape
    kind = _storage_kind(query.dtype, name)
    kv = kind if query.dtype == k_cache.dtype and kv_cache_dtype is None else kv_element_type(k_cache.dtype,
                                                                                               kv_cache_dtype, name)
    if kv != kind and (kind != "f16" or kv not in ATTN_KV_TYPES):
        raise ValueError(f"{name}: query dtype {query.dtype} and cache dtype {k_cache.dtype} differ")
    dim -= 4 if kv.startswith("kv_fp8") else 0  # an fp8 row: its codes, then its float32 scale
    if query.ndim != 3 or query.shape[2] != dim:
        raise ValueError(f"{name}: query must be [T, H, {dim}], got {tuple(query.shape)}")
    if dim not in head_dims:
        raise ValueError(f"{name}: head_dim {dim} is not supported on the GPU ({head_dims})")
    if block_size not in ATTN_BLOCK_SIZES:
        raise ValueError(f"{name}: block_size {block_size} is not supported on the GPU ({ATTN_BLOCK_SIZES})")
    if k_cache.data.ptr % 16 or v_cache.data.ptr % 16:
        raise ValueError(f"{name}: KV caches must be 16-byte aligned")
    return kind, kv


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
    """Validate host-side batch metadata (batch_checks.check_metadata); returns max(seq_lens)."""
    return check_metadata(query_start_loc, seq_lens, block_tables, num_tokens, block_size, num_blocks,
                          "paged_attention")


def _device_int32(a):
    import cupy

    if is_cupy_array(a):
        return cupy.ascontiguousarray(a, dtype=cupy.int32)
    return cupy.asarray(np.ascontiguousarray(a, dtype=np.int32))


def plan_attention(query_shape, cache_shape, query_start_loc, seq_lens, block_tables) -> None:
    """None: the GPU step's metadata is checked and uploaded once already (models/device_batch.to_device)."""
    return None


def paged_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float, plan=None,
                    sliding_window: int | None = None, kv_cache_dtype: str | None = None, out=None, workspace=None):
    """Unified paged attention over a flat varlen batch: query [T, H, D] -> out [T, H, D], float16 or bfloat16
    (_storage_kind; caches of the query's dtype, or for a float16 query bfloat16 or fp8 caches: kv_cache_dtype,
    read from the caches' dtype when None; fp8 rows hold D codes and their scale). `plan` is
    plan_attention's None (accepted for the op table's one signature). `sliding_window`: None, or W (a query
    at p sees keys p - W < k <= p; the blocks before the window's are never read).

    One launch of paged_attention_kernel covers prefill chunks and decodes; decodes longer than
    PARTITION_SIZE are split into partitions and combined by a second, small reduce launch. `out`: where the
    result goes (a C-contiguous [T, H, D]); `workspace` (models/workspace.py): where the partials go, so a
    captured decode step allocates nothing.
    """
    import cupy

    window = check_sliding_window(sliding_window)
    kind, kv = _check_inputs("paged_attention", query, k_cache, v_cache, ATTN_HEAD_DIMS, kv_cache_dtype)
    num_blocks, block_size, num_kv, _ = k_cache.shape
    dim = query.shape[2]
    num_tokens, num_heads, _ = query.shape
    num_seqs = int(seq_lens.shape[0])
    launch = attention_launch(num_heads, num_kv, num_tokens, num_seqs)
    if kv.startswith("kv_fp8") and launch.block_m not in FP8_BLOCK_MS:
        raise ValueError(f"paged_attention: {num_heads // num_kv} query heads per kv head over an fp8 cache; the GPU "
                         f"kernel supports at most {max(FP8_BLOCK_MS)} there")
    if out is None:
        out = cupy.empty((num_tokens, num_heads, dim), dtype=query.dtype)
    elif tuple(out.shape) != (num_tokens, num_heads, dim) or out.dtype != query.dtype or not out.flags.c_contiguous:
        raise ValueError(f"paged_attention: out must be a C-contiguous {query.dtype} array of "
                         f"{(num_tokens, num_heads, dim)}")
    if num_tokens == 0:
        return out
    if is_cupy_array(seq_lens) or is_cupy_array(query_start_loc) or is_cupy_array(block_tables):
        max_seq_len = int(block_tables.shape[1]) * block_size  # a bound; reading the real one would sync
    else:
        max_seq_len = check_metadata(query_start_loc, seq_lens, block_tables, num_tokens, block_size, num_blocks,
                                     "paged_attention")
    qsl = _device_int32(query_start_loc)
    lens = _device_int32(seq_lens)
    tables = _device_int32(block_tables)
    max_parts = max(1, math.ceil(max_seq_len / PARTITION_SIZE))
    if window and max_seq_len > PARTITION_SIZE:  # a split decode's window spans at most this many partitions
        max_parts = min(max_parts, (window - 1) // PARTITION_SIZE + 2)
    chunk = partition_chunk(num_seqs, num_heads, dim, max_parts)
    if max_parts > 1 and workspace is not None:  # one buffer: acc, then max/sum
        n_acc = chunk * num_heads * max_parts * dim
        parts = workspace.take("attention_partials", (n_acc + chunk * num_heads * max_parts * 2,), cupy.float32)
        part_acc = parts[:n_acc].reshape(chunk, num_heads, max_parts, dim)
        part_ml = parts[n_acc:].reshape(chunk, num_heads, max_parts, 2)
    elif max_parts > 1:
        part_acc = cupy.empty((chunk, num_heads, max_parts, dim), dtype=cupy.float32)
        part_ml = cupy.empty((chunk, num_heads, max_parts, 2), dtype=cupy.float32)
    else:
        part_acc = part_ml = _dummy()
    query = _inner_contiguous(query, "query")
    # (the tensor-core prefill reads caches of the query's dtype only)
    prefill_elsewhere = num_tokens != num_seqs and kv == kind and tensor_core_prefill_enabled()
    if prefill_elsewhere:  # chunks of 2+ tokens on tensor cores; the launch below does the decodes only
        _launch_prefill(out, query, k_cache, v_cache, qsl, lens, tables, scale, window, kind)
    attend = _kernel("paged_attention", attention_kernel_name(dim, block_size, launch.block_m, kind, kv))
    reduce = _kernel("paged_attention", attention_reduce_name(dim, kind)) if max_parts > 1 else None
    shared = attention_shared_bytes(dim, launch.block_m)  # the tiles' dynamic shared memory (the loader opted in)
    for begin in range(0, num_seqs, chunk):  # one range, unless the partials would exceed the cap
        end = min(num_seqs, begin + chunk)
        attend(
            (launch.num_tiles, num_kv, max_parts), (ATTN_THREADS,),
            (out, part_acc, part_ml, query, _i64(_elements(query.strides[0], 2, "query")),
             _i64(_elements(query.strides[1], 2, "query")), k_cache, v_cache, qsl, lens, tables,
             _i64(tables.shape[1]), _i32(num_seqs), _i32(num_heads), _i32(num_kv), _i32(launch.block_q),
             _i32(max_parts), np.float32(scale * LOG2E), _i32(begin), _i32(end), _i32(window),
             _i32(prefill_elsewhere)),
            shared_mem=shared,
        )
        if reduce is not None:
            reduce((end - begin, num_heads), (dim,),
                   (out, part_acc, part_ml, qsl, lens, _i32(num_heads), _i32(max_parts), _i32(begin), _i32(window)))
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



def prefill_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float,
                      sliding_window: int | None = None, out=None):
    """Tensor-core attention (prefill_attention.cu) for the rows of the sequences with two or more new tokens;
    the rows of single-token sequences are left as they are in `out` (allocated, uninitialised, when None).
    query [T, H, D] and the caches: float16, or bfloat16 (ml_dtypes' type, or uint16 arrays of its bits), one
    dtype; D in PREFILL_HEAD_DIMS. Same metadata and sliding_window contract as paged_attention."""
    import cupy

    window = check_sliding_window(sliding_window)
    kind, kv = _check_inputs("prefill_attention", query, k_cache, v_cache, PREFILL_HEAD_DIMS)
    if kv != kind:
        raise ValueError(f"prefill_attention: reads caches of the query's dtype only ({query.dtype}); paged_attention "
                         f"reads {k_cache.dtype} caches")
    num_blocks, block_size, num_kv, dim = k_cache.shape
    num_tokens, num_heads, _ = query.shape
    if num_heads % num_kv:
        raise ValueError(f"prefill_attention: {num_heads} query heads is not a multiple of {num_kv} kv heads")
    if out is None:
        out = cupy.empty(query.shape, dtype=query.dtype)
    elif tuple(out.shape) != tuple(query.shape) or out.dtype != query.dtype or not out.flags.c_contiguous:
        raise ValueError(f"prefill_attention: out must be a C-contiguous {query.dtype} array of {tuple(query.shape)}")
    if num_tokens == 0:
        return out
    if not (is_cupy_array(seq_lens) or is_cupy_array(query_start_loc) or is_cupy_array(block_tables)):
        check_metadata(query_start_loc, seq_lens, block_tables, num_tokens, block_size, num_blocks,
                       "prefill_attention")
    query = _inner_contiguous(query, "query")
    _launch_prefill(out, query, k_cache, v_cache, _device_int32(query_start_loc), _device_int32(seq_lens),
                    _device_int32(block_tables), scale, window, kind)
    return out


def prefill_num_tiles(num_tokens: int, num_seqs: int) -> int:
    """grid.x of prefill_attention_kernel: an upper bound on the 64-row query tiles, from T and B only."""
    return (num_tokens - num_seqs) // PREFILL_BLOCK_Q + num_seqs


def _launch_prefill(out, query, k_cache, v_cache, qsl, lens, tables, scale: float, window: int, kind: str) -> None:
    """One launch of prefill_attention_kernel; metadata already checked and on the device."""
    num_tokens, num_heads, dim = query.shape
    _, block_size, num_kv, _ = k_cache.shape
    num_seqs = int(lens.shape[0])
    q_token = _elements(query.strides[0], query.itemsize, "query")
    q_head = _elements(query.strides[1], query.itemsize, "query")
    if q_token % 2 or q_head % 2 or query.data.ptr % 4:
        raise ValueError("prefill_attention: query rows must start on 4-byte boundaries (even strides)")
    fn = _kernel("prefill_attention", prefill_kernel_name(dim, block_size, kind))
    fn((prefill_num_tiles(num_tokens, num_seqs), num_heads), (PREFILL_THREADS,),
       (out, query, _i64(q_token), _i64(q_head), k_cache, v_cache, qsl, lens, tables, _i64(tables.shape[1]),
        _i32(num_seqs), _i32(num_heads), _i32(num_kv), np.float32(scale * LOG2E), _i32(window)))
