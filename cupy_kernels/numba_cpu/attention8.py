"""8-bit KV caches (kv_cache_dtype int8, fp8_e4m3, fp8_e5m2: rows of values followed by their float32 scale, one
per token and kv head; kv_layout.py) in the numba attention loop nest: attention.py's very loop nest, compiled once
more for each kind (as attention16.py does for the 16-bit ones) with its caches read as int8 and its K and V runs
converting each loaded vector to float32 in registers and multiplying it by its row's scale
(attention_ir.SCALED_RUNS: int8 by a signed conversion, fp8 by integer ops on its bits, no lookup and no float16 on
any code path; the key-by-key tail through attention_ir.SCALED_TO_FLOAT32). Each value so read is the float32
reference/kv_convert.decode gives, and the arithmetic after it the float32 loop nest's: the result has the float32
loop nest's bits over the decoded cache (tests/cupy_kernels/test_kv_dtypes.py). No dequantized copy is made.
"""

from __future__ import annotations

import functools
import types as pytypes

import numpy as np

from . import attention, attention_ir as ir_loops, launch
from ..kv_layout import layout_of_array
from .setup import JIT, numba

RUN = ir_loops.RUN
KINDS = ir_loops.SCALED_KINDS


def _runs(kind: str):
    """attention._scores and _accumulate over `kind` rows (int8 arrays; a row's last 4 bytes: its scale)."""
    dot_run, axpy_run = ir_loops.SCALED_RUNS[kind]
    to_float32 = ir_loops.SCALED_TO_FLOAT32[kind]
    lanes, address, scale_at = ir_loops.LANES, ir_loops.address, ir_loops.scale_at

    @numba.njit(inline="always", **JIT)
    def scores(q, s, k_cache, r, block, h, off, j, nv, head_dim):
        row = k_cache.shape[2] * k_cache.shape[3]
        key = (block * k_cache.shape[1] + j) * row + h * k_cache.shape[3]
        if j + RUN <= nv and head_dim % lanes == 0:
            dot_run(address(q), r * head_dim, address(k_cache), key, row, head_dim, address(s),
                    r * s.shape[1] + off + j)
        else:
            for jj in range(j, min(nv, j + RUN)):
                sc = scale_at(address(k_cache), key + (jj - j) * row + head_dim)
                dot = np.float32(0.0)
                for d in range(head_dim):
                    dot += q[r, d] * to_float32(k_cache[block, jj, h, d], sc)
                s[r, off + jj] = dot

    @numba.njit(inline="always", **JIT)
    def accumulate(s, acc, v_cache, r, block, h, off, j, nv, head_dim):
        row = v_cache.shape[2] * v_cache.shape[3]
        value = (block * v_cache.shape[1] + j) * row + h * v_cache.shape[3]
        if j + RUN <= nv and head_dim % lanes == 0:
            axpy_run(address(s), r * s.shape[1] + off + j, address(v_cache), value, row, head_dim, address(acc),
                     r * head_dim)
        else:
            for jj in range(j, min(nv, j + RUN)):
                p = s[r, off + jj]
                sc = scale_at(address(v_cache), value + (jj - j) * row + head_dim)
                for d in range(head_dim):
                    acc[r, d] += p * to_float32(v_cache[block, jj, h, d], sc)

    return scores, accumulate


@functools.lru_cache(maxsize=None)
def kernel(kind: str):
    """The loop nest over `kind` caches (compiled on first use: warm_up does it at an engine's start)."""
    scores, accumulate = _runs(kind)
    chunk = attention._attention_chunk
    globals_ = dict(chunk.__globals__, _scores=scores, _accumulate=accumulate, _KV_STORAGE=np.int8, _KV_BYTES=1)
    variant = pytypes.FunctionType(chunk.__code__, globals_, f"_attention_chunk_{kind}")
    return numba.njit(**dict(JIT, cache=False))(variant)


def kind_of(k_cache, v_cache) -> str | None:
    """The 8-bit kind of a pair of C-contiguous caches of one dtype this loop nest takes, else None."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype.itemsize != 1:
        return None
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        return None
    try:
        kind = layout_of_array(k_cache)
    except ValueError:
        return None
    return kind if kind in KINDS else None


def as_bytes(cache):
    """An 8-bit cache as int8 (a view: fp8's bits)."""
    return cache if cache.dtype == np.int8 else cache.view(np.int8)


def warm_up(kind: str) -> None:
    """Compile the loop nest for `kind` caches on this thread and on the launcher, and the 8-bit cache write
    (cache_write8.py)."""
    from ..kv_layout import kv_cache_layout
    from . import cache_write8

    cache_write8.warm_up()
    storage = kv_cache_layout(kind, np.float32).storage
    cache = np.zeros((2, 4, 1, 16 + 4), dtype=storage)
    qsl, lens = np.array([0, 2, 3], dtype=np.int64), np.array([2, 5], dtype=np.int64)
    tables = np.zeros((2, 2), dtype=np.int32)
    query = np.ones((3, 2, 16), np.float32)
    for threads in (1, 2):
        items, bounds = attention._work_items(qsl, lens, attention.Q_TILE, threads)
        plan = attention.dataclasses.replace(
            attention.plan_attention(query.shape, cache.shape, qsl, lens, tables), bounds=bounds,
            step_words=launch.pack(qsl, lens, tables, items, bounds))
        attention._run(plan, query, as_bytes(cache), as_bytes(cache), 1.0, 0, np.empty(query.shape, np.float32),
                       kernel(kind))
