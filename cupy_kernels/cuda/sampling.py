"""The CUDA sampling helpers: argmax over rows and the sort-free sampler (sampling.cu). Not dispatched from the
op layer (the runtime's sampler is backend-generic); ops.py re-exports them, and callers reach them there."""

from __future__ import annotations

import numpy as np

from .launch import _elements, _i32, _i64, _inner_contiguous, _next_pow2, _storage_type, is_cupy_array
from .modules import _kernel

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
