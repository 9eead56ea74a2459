"""The numba set's KV cache writes: reshape_and_cache, and rotary_and_cache (the query and key rotated and the
key and value written to their slots in one pass over the qkv projection). Same results, bit for bit, as the
numpy references in reference/paged_attention.py (tests/cupy_kernels/test_numba_ops.py).

rotary_and_cache shares a step's tokens out over the threads from PARALLEL_MIN_TOKENS (the rows are independent:
the thread count never changes a bit). In bench/throughput.py's 256-request run, calls alternating between one
and two threads: a prefill step's 2,048 tokens 1,286 -> 775 us a layer; a decode step's 256, 199 us either way
(reading qkv from both cores' caches and the writes to slots all over the pool bound it, not the arithmetic).
"""

from __future__ import annotations

import functools

import numpy as np

from . import cache_write8, cache_write16, launch
from ..kv_layout import head_dim_of
from ..batch_checks import check_slot_mapping
from .attention_ir import address
from .numerics import rotate, store_fence, stream_copy
from .setup import JIT_EXACT, apply_threads, call_compiled, native_address, numba

PARALLEL_MIN_TOKENS = 512  # tokens from which rotary_and_cache uses numba's thread pool
_F32 = np.dtype(np.float32)


@numba.njit(**JIT_EXACT)
def _reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    block_size = k_cache.shape[1]
    for t in range(key.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        b, r = slot // block_size, slot % block_size
        for h in range(key.shape[1]):  # element loops: numba's slice assignment costs ~0.5 us per call
            kd, vd, ks, vs = k_cache[b, r, h], v_cache[b, r, h], key[t, h], value[t, h]
            for d in range(key.shape[2]):
                kd[d] = ks[d]
                vd[d] = vs[d]


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """paged_attention.reshape_and_cache without the fancy-index temporaries: each new row is copied
    straight from the qkv projection (key/value are strided views of it) into its slot."""
    if key.dtype != k_cache.dtype or k_cache.dtype != _F32:
        from ..reference import paged_attention

        return paged_attention.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    slot_mapping = np.asarray(slot_mapping, dtype=np.int64)
    check_slot_mapping(slot_mapping, k_cache.shape[0] * k_cache.shape[1], "reshape_and_cache")
    _reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


@numba.njit(**JIT_EXACT)
def _rotary_and_cache(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping, out, stream, t0, t1):
    """Tokens t0 .. t1 - 1, on one thread. Each head is rotated by numerics.rotate (vector IR) straight from the
    C-contiguous qkv: the query into `out`, the key into a scratch row copied to its cache slot with the
    value (numba's loop over a head's 32 pairs spent more in run-time alias checks than in the products: a
    256-token decode step's 30 layers 52 -> 29 us a layer without the cache writes). `stream`: the key and value
    rows go to their slots as whole lines by non-temporal stores, which do not read the line from memory first:
    a decode step writes to slots all over a pool far larger than the caches (256 tokens into SmolLM2's 4 GiB
    pool: 149-175 -> 83-94 us a layer; a prefill of 16 prompts of 128 tokens 772-815 -> 668 us)."""
    head_dim = k_cache.shape[3]
    half = head_dim // 2
    k_start = num_heads * head_dim
    v_start = k_start + num_kv_heads * head_dim
    block_size = k_cache.shape[1]
    src, cs, sn = address(qkv), address(cos), address(sin)
    key = np.empty(head_dim, dtype=np.float32)  # a rotated key, then copied to its slot (a cache of any layout)
    q_out, k_out = address(out), address(key)
    k_at, v_at = np.int64(k_cache.ctypes.data), np.int64(v_cache.ctypes.data)  # for stream_copy
    stream = stream and k_at % 64 == 0 and v_at % 64 == 0  # (whole lines only from a line's start)
    width, cs_width = qkv.shape[1], cos.shape[1]
    for t in range(t0, t1):
        for h in range(num_heads):
            rotate(src, t * width + h * head_dim, cs, sn, t * cs_width, q_out, (t * num_heads + h) * head_dim, half)
        slot = slot_mapping[t]
        if slot < 0:
            continue
        b, r = slot // block_size, slot % block_size
        for h in range(num_kv_heads):  # the rotated key into its slot, then the value
            rotate(src, t * width + k_start + h * head_dim, cs, sn, t * cs_width, k_out, 0, half)
            a = v_start + h * head_dim
            if stream:  # whole 64-byte lines, streamed to memory without reading them first
                row = 4 * (slot * num_kv_heads * head_dim + h * head_dim)
                stream_copy(k_out, k_at + row, head_dim)
                stream_copy(src + 4 * (t * width + a), v_at + row, head_dim)
            else:
                for d in range(head_dim):
                    k_cache[b, r, h, d] = key[d]
                    v_cache[b, r, h, d] = qkv[t, a + d]
    if stream:
        store_fence()


def rotary_and_cache(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping) -> np.ndarray:
    """paged_attention.rotary_and_cache in one compiled pass over qkv (apply_rotary on the query and key
    heads, reshape_and_cache of the rotated key and the value), with the same bits. 16-bit caches (kv_cache_dtype
    bfloat16, float16): rounded as they are written (cache_write16.py); 8-bit ones (int8, fp8_e4m3, fp8_e5m2)
    scaled and rounded, each row's scale after it (cache_write8.py). Other dtypes (cos and sin included) take
    the reference."""
    sixteen = k_cache.dtype != _F32 and cache_write16.takes(k_cache, v_cache)
    eight = k_cache.dtype != _F32 and not sixteen and cache_write8.takes(k_cache, v_cache)
    if not ((qkv.dtype == _F32 and (sixteen or eight or k_cache.dtype == v_cache.dtype == _F32))
            and cos.dtype == sin.dtype == _F32):
        from ..reference import paged_attention

        return paged_attention.rotary_and_cache(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache,
                                                slot_mapping)
    # The loop trusts these shapes (no bounds checks): checked here.
    head_dim = head_dim_of(k_cache) if k_cache.ndim == 4 else -1
    if (qkv.ndim != 2 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2] != num_kv_heads
            or num_heads < 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim
            or head_dim % 2 or cos.shape != sin.shape or cos.ndim != 2 or cos.shape[0] < qkv.shape[0]
            or cos.shape[1] < head_dim // 2):
        raise ValueError(f"rotary_and_cache: qkv {qkv.shape} of {num_heads} query and {num_kv_heads} kv heads, cos "
                         f"{cos.shape}, sin {sin.shape} and caches {k_cache.shape}, {v_cache.shape} do not fit")
    t = qkv.shape[0]
    slot_mapping = np.ascontiguousarray(slot_mapping, dtype=np.int64)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if slot_mapping.shape != (t,):
        raise ValueError(f"rotary_and_cache: slot_mapping {slot_mapping.shape} for {t} tokens")
    check_slot_mapping(slot_mapping, num_slots, "rotary_and_cache")
    out = np.empty((t, num_heads, head_dim), dtype=_F32)
    if eight:
        cache_write8.rotary_and_cache8(np.ascontiguousarray(qkv), num_heads, num_kv_heads, np.ascontiguousarray(cos),
                                       np.ascontiguousarray(sin), k_cache, v_cache, slot_mapping, out)
        return out
    if sixteen:
        cache_write16.rotary_and_cache16(np.ascontiguousarray(qkv), num_heads, num_kv_heads, np.ascontiguousarray(cos),
                                         np.ascontiguousarray(sin), k_cache, v_cache, slot_mapping, out)
        return out
    # Rows of whole 64-byte lines in C-contiguous caches on a 64-byte boundary (the KV pool's: a page; the
    # kernel checks the boundary: two ctypes addresses here cost ~2 us a call) are streamed
    # (numerics.stream_copy); other caches are written element by element.
    stream = bool(k_cache.shape[3] % 16 == 0 and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous)
    args = (np.ascontiguousarray(qkv), np.int64(num_heads), np.int64(num_kv_heads), np.ascontiguousarray(cos),
            np.ascontiguousarray(sin), k_cache, v_cache, slot_mapping, out, stream)
    # (a few tokens: the serial kernel, numba's thread count left as it is)
    parts = min(apply_threads(parallel=True), t) if t >= PARALLEL_MIN_TOKENS else 1
    if parts == 1 or not (k_cache.flags.carray and v_cache.flags.carray):  # the serial kernel itself
        _rotary_and_cache(*args, np.int64(0), np.int64(t))
    else:  # the model's caches (C-contiguous, writable): the tokens in `parts` ranges over the threads
        words = launch.pack(*args, parts, _part_address())
        launch.run_items(launch.item_address(_ROTARY_PARTS), parts, words)
    return out


def _rotary_part(i, words):
    """Part i of `parts` ranges of about equal size of the tokens, by the serial kernel at its address (a prange
    around the loop itself compiled several times as long; a prange of its own around the call, 0.6 s). Run by
    launch.py's one prange; `words`: rotary_and_cache's arguments (launch.pack), parts, the kernel's address."""
    qkv = launch.array2(words, 0, np.float32)
    cos, sin = launch.array2(words, 5, np.float32), launch.array2(words, 8, np.float32)
    k_cache, v_cache = launch.array4(words, 11, np.float32), launch.array4(words, 16, np.float32)
    slot_mapping = launch.array1(words, 21, np.int64)
    out = launch.array3(words, 23, np.float32)
    n, parts = qkv.shape[0], words[28]
    call_compiled(words[29], (qkv, words[3], words[4], cos, sin, k_cache, v_cache, slot_mapping, out, words[27] != 0,
                              np.int64(i * n // parts), np.int64((i + 1) * n // parts)))


_ROTARY_PARTS = numba.njit(**JIT_EXACT)(_rotary_part)


@functools.lru_cache(maxsize=None)
def _part_address() -> int:
    """The serial kernel's machine code for the arrays _rotary_part rebuilds (C-contiguous, writable)."""
    f32 = lambda *shape: np.zeros(shape, dtype=_F32)  # noqa: E731
    zero = np.int64(0)
    return native_address(_rotary_and_cache, (f32(1, 1), zero, zero, f32(1, 1), f32(1, 1), f32(1, 1, 1, 1),
                                              f32(1, 1, 1, 1), np.zeros(1, dtype=np.int64), f32(1, 1, 1), True,
                                              zero, zero))
