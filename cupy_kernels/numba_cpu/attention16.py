"""16-bit KV caches (kv_cache_dtype bfloat16 or float16) in the numba attention loop nest: attention.py's very loop
nest, compiled once more with its caches read as uint16 (bfloat16's or float16's bits: numba has no float16 on the
CPU) and its K and V runs converting each loaded vector to float32 in registers (attention_ir.dot_run_bf16, ...;
the key-by-key tail through bf16_to_float32 / f16_to_float32). No dequantized copy of the cache is made; the
arithmetic after the load is the float32 loop nest's, so the result is the numpy reference's over the stored
values (tests/cupy_kernels/test_kv_dtypes.py).

The variant is the loop nest's code object with other globals (its runs, the caches' dtype, a value's bytes for the
prefetch hints), compiled without numba's on-disk cache (its index would be the float32 kernel's): an engine with a
16-bit pool compiles it at start (warm_up), the float32 engines never do.
"""

from __future__ import annotations

import functools
import types as pytypes

import numpy as np

from . import attention, attention_ir as ir_loops, launch
from .setup import CODE_PATH, JIT, numba

RUN = ir_loops.RUN
_U16 = np.dtype(np.uint16)
KINDS = ("bfloat16", "float16")


@numba.njit(inline="always", **JIT)
def _scores_bf16(q, s, k_cache, r, block, h, off, j, nv, head_dim):
    """attention._scores over bfloat16 bits."""
    if j + RUN <= nv and head_dim % ir_loops.LANES == 0:
        row = k_cache.shape[2] * head_dim
        key = (block * k_cache.shape[1] + j) * row + h * head_dim
        ir_loops.dot_run_bf16(ir_loops.address(q), r * head_dim, ir_loops.address(k_cache), key, row, head_dim,
                              ir_loops.address(s), r * s.shape[1] + off + j)
    else:
        for jj in range(j, min(nv, j + RUN)):
            dot = np.float32(0.0)
            for d in range(head_dim):
                dot += q[r, d] * ir_loops.bf16_to_float32(k_cache[block, jj, h, d])
            s[r, off + jj] = dot


@numba.njit(inline="always", **JIT)
def _accumulate_bf16(s, acc, v_cache, r, block, h, off, j, nv, head_dim):
    """attention._accumulate over bfloat16 bits."""
    if j + RUN <= nv and head_dim % ir_loops.LANES == 0:
        row = v_cache.shape[2] * head_dim
        value = (block * v_cache.shape[1] + j) * row + h * head_dim
        ir_loops.axpy_run_bf16(ir_loops.address(s), r * s.shape[1] + off + j, ir_loops.address(v_cache), value, row,
                               head_dim, ir_loops.address(acc), r * head_dim)
    else:
        for jj in range(j, min(nv, j + RUN)):
            p = s[r, off + jj]
            for d in range(head_dim):
                acc[r, d] += p * ir_loops.bf16_to_float32(v_cache[block, jj, h, d])


@numba.njit(inline="always", **JIT)
def _scores_f16(q, s, k_cache, r, block, h, off, j, nv, head_dim):
    """attention._scores over float16 bits."""
    if j + RUN <= nv and head_dim % ir_loops.LANES == 0:
        row = k_cache.shape[2] * head_dim
        key = (block * k_cache.shape[1] + j) * row + h * head_dim
        ir_loops.dot_run_f16(ir_loops.address(q), r * head_dim, ir_loops.address(k_cache), key, row, head_dim,
                             ir_loops.address(s), r * s.shape[1] + off + j)
    else:
        for jj in range(j, min(nv, j + RUN)):
            dot = np.float32(0.0)
            for d in range(head_dim):
                dot += q[r, d] * ir_loops.f16_to_float32(k_cache[block, jj, h, d])
            s[r, off + jj] = dot


@numba.njit(inline="always", **JIT)
def _accumulate_f16(s, acc, v_cache, r, block, h, off, j, nv, head_dim):
    """attention._accumulate over float16 bits."""
    if j + RUN <= nv and head_dim % ir_loops.LANES == 0:
        row = v_cache.shape[2] * head_dim
        value = (block * v_cache.shape[1] + j) * row + h * head_dim
        ir_loops.axpy_run_f16(ir_loops.address(s), r * s.shape[1] + off + j, ir_loops.address(v_cache), value, row,
                              head_dim, ir_loops.address(acc), r * head_dim)
    else:
        for jj in range(j, min(nv, j + RUN)):
            p = s[r, off + jj]
            for d in range(head_dim):
                acc[r, d] += p * ir_loops.f16_to_float32(v_cache[block, jj, h, d])


_RUNS = {"bfloat16": (_scores_bf16, _accumulate_bf16), "float16": (_scores_f16, _accumulate_f16)}


@functools.lru_cache(maxsize=None)
def kernel(kind: str):
    """The loop nest over `kind` caches (compiled on first use: warm_up does it at an engine's start)."""
    scores, accumulate = _RUNS[kind]
    chunk = attention._attention_chunk
    globals_ = dict(chunk.__globals__, _scores=scores, _accumulate=accumulate, _KV_STORAGE=np.uint16, _KV_BYTES=2)
    variant = pytypes.FunctionType(chunk.__code__, globals_, f"_attention_chunk_{kind}")
    return numba.njit(**dict(JIT, cache=False))(variant)


def kind_of(k_cache, v_cache) -> str | None:
    """"bfloat16" or "float16" for a pair of C-contiguous 16-bit caches of one dtype this loop nest takes, else None
    (the reference then runs them)."""
    if k_cache.dtype != v_cache.dtype or not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        return None
    if k_cache.dtype == np.float16 and CODE_PATH == "baseline":  # no F16C: LLVM would call a runtime helper
        return None
    return {_U16: "bfloat16", np.dtype(np.float16): "float16"}.get(k_cache.dtype)


def as_bits(cache):
    """A 16-bit cache as uint16 (a view: float16's bits)."""
    return cache if cache.dtype == _U16 else cache.view(np.uint16)


def warm_up(kind: str) -> None:
    """Compile the loop nest for `kind` caches (and the launcher's item for it), as attention.warm_up does for
    float32: on this thread and on the launcher; and the 16-bit cache write (cache_write16.py)."""
    from . import cache_write16

    cache_write16.warm_up()
    if kind == "float16" and CODE_PATH == "baseline":
        return
    storage = np.uint16 if kind == "bfloat16" else np.float16
    cache = np.zeros((2, 4, 1, 16), dtype=storage)
    qsl, lens = np.array([0, 2, 3], dtype=np.int64), np.array([2, 5], dtype=np.int64)
    tables = np.zeros((2, 2), dtype=np.int32)
    query = np.ones((3, 2, 16), np.float32)
    for threads in (1, 2):
        items, bounds = attention._work_items(qsl, lens, attention.Q_TILE, threads)
        plan = attention.dataclasses.replace(
            attention.plan_attention(query.shape, cache.shape, qsl, lens, tables), bounds=bounds,
            step_words=launch.pack(qsl, lens, tables, items, bounds))
        attention._run(plan, query, as_bits(cache), as_bits(cache), 1.0, 0, np.empty(query.shape, np.float32),
                       kernel(kind))
