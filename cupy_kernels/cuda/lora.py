"""Launchers of lora.cu: the batched LoRA shrink and expand on CuPy arrays, the signatures of
reference/lora.py. Not in the CUDA op table yet: the GPU step does not upload a batch's LoRA slots (the engine
refuses enable_lora on the GPU), so these are tested alone (tests/cupy_kernels/test_kernels_on_host.py)."""

from __future__ import annotations

from .launch import _elements, _i32, _i64, _inner_contiguous, _storage_type
from .modules import _kernel

THREADS = 256  # 8 warps: a warp per rank row in shrink, threads over the outputs in expand


def _slots(slots):
    import cupy

    return cupy.ascontiguousarray(cupy.asarray(slots), dtype=cupy.int32)


def lora_shrink(x, lora_a, slots, ranks=None, out=None):
    """t [T, R] float32 = A[slot] @ x per row; rows with slot -1 are zero (ranks: reference/lora.py's hint,
    unused here: the zero padding is multiplied). out: a C-contiguous float32 [T, R] buffer to write (a decode
    graph's workspace), else a new array."""
    import cupy

    if x.ndim != 2 or lora_a.ndim != 3 or lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_shrink: x [T, in] and lora_a [L, R, in], got {tuple(x.shape)} and "
                         f"{tuple(lora_a.shape)}")
    if lora_a.dtype != x.dtype:
        raise ValueError("lora_shrink: x and lora_a must share one dtype on the GPU")
    t_name = _storage_type(x.dtype, "lora_shrink")
    x = _inner_contiguous(x, "lora_shrink x")
    rows, rank = x.shape[0], lora_a.shape[1]
    if out is None:
        out = cupy.empty((rows, rank), dtype=cupy.float32)
    elif tuple(out.shape) != (rows, rank) or out.dtype != cupy.float32 or not out.flags.c_contiguous:
        raise ValueError(f"lora_shrink: out must be a C-contiguous float32 array of {(rows, rank)}")
    if rows and rank:
        _kernel("lora", f"lora_shrink_kernel<{t_name}>")(
            (rows,), (THREADS,),
            (out, x, _i64(_elements(x.strides[0], x.itemsize, "x")), cupy.ascontiguousarray(lora_a), _slots(slots),
             _i32(x.shape[1]), _i32(rank)))
    return out


def lora_expand(t, lora_b, scale, slots, y, ranks=None, bounds=None):
    """y[i] += scale[slot] * t[i] @ B[slot] ([L, R, out]) in place for rows with a slot; returns y."""
    import cupy

    if y.ndim != 2 or lora_b.ndim != 3 or lora_b.shape[2] != y.shape[1] or t.shape != (y.shape[0], lora_b.shape[1]):
        raise ValueError(f"lora_expand: t [T, R], lora_b [L, R, out] and y [T, out], got {tuple(t.shape)}, "
                         f"{tuple(lora_b.shape)} and {tuple(y.shape)}")
    if lora_b.dtype != y.dtype:
        raise ValueError("lora_expand: y and lora_b must share one dtype on the GPU")
    t_name = _storage_type(y.dtype, "lora_expand")
    y2 = _inner_contiguous(y, "lora_expand y")
    if y2.data.ptr != y.data.ptr:
        raise ValueError("lora_expand: y must have contiguous rows (it is written in place)")
    rows = y.shape[0]
    if rows and lora_b.shape[1]:
        _kernel("lora", f"lora_expand_kernel<{t_name}>")(
            (rows,), (THREADS,),
            (y, _i64(_elements(y.strides[0], y.itemsize, "y")), cupy.ascontiguousarray(t, dtype=cupy.float32),
             cupy.ascontiguousarray(lora_b), cupy.ascontiguousarray(cupy.asarray(scale), dtype=cupy.float32),
             _slots(slots), _i32(y.shape[1]), _i32(lora_b.shape[1])))
    return y

