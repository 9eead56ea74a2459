"""numba versions of the batched LoRA ops (reference/lora.py): one launch.py item a row, base rows skipped.

A row's shrink is R dot products of length `in` against its slot's A; its expand `out` dot products of length
R against its slot's B, added into y scaled. Every row is computed from that row alone (batch invariance), by
the same compiled item on whichever thread; rows whose slot is -1 return at once, so a step's base rows cost
one load each. Decode steps (few rows) run on the calling thread, as the elementwise kernels do (ops.py).
"""

from __future__ import annotations

import numpy as np

from .launch import array1, array2, array3, item_address, run_parts
from .setup import JIT, apply_threads, numba

PARALLEL_MIN_ROWS = 64  # rows from which the LoRA items share numba's threads
_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)
_f32, _i32 = np.float32, np.int32  # (the dtype argument of launch.array1 .. array3 inside the items)


def _shrink_row(i, words):
    """Row i of lora_shrink (words: x [T, in], lora_a [L, R, in], slots [T] int32, out [T, R])."""
    slots = array1(words, 7, _i32)
    s = slots[i]
    if s < 0:
        return
    x, a, out = array2(words, 0, _f32), array3(words, 3, _f32), array2(words, 9, _f32)
    n_in = x.shape[1]
    for r in range(a.shape[1]):
        acc = np.float32(0.0)
        for k in range(n_in):
            acc += a[s, r, k] * x[i, k]
        out[i, r] = acc


def _expand_row(i, words):
    """Row i of lora_expand (words: t [T, R], lora_b [L, out, R], scale [L], slots [T] int32, y [T, out])."""
    slots = array1(words, 9, _i32)
    s = slots[i]
    if s < 0:
        return
    t, b, scale, y = array2(words, 0, _f32), array3(words, 3, _f32), array1(words, 7, _f32), array2(words, 11, _f32)
    rank = t.shape[1]
    sc = scale[s]
    for o in range(b.shape[1]):
        acc = np.float32(0.0)
        for r in range(rank):
            acc += b[s, o, r] * t[i, r]
        y[i, o] += sc * acc


_SHRINK = numba.njit(**JIT)(_shrink_row)
_EXPAND = numba.njit(**JIT)(_expand_row)


def _run(item, count: int, parts: tuple) -> None:
    parallel = count >= PARALLEL_MIN_ROWS
    if parallel:
        apply_threads(parallel=True)
    run_parts(item_address(item), count, parts, serial=not parallel)


def _slots(slots) -> np.ndarray:
    return np.ascontiguousarray(slots, dtype=_I32)


def lora_shrink(x: np.ndarray, lora_a: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """reference.lora.lora_shrink: t [T, R] = A[slot] @ x per row (zero for base rows)."""
    x = np.ascontiguousarray(x, dtype=_F32)
    out = np.zeros((x.shape[0], lora_a.shape[1]), dtype=_F32)
    _run(_SHRINK, x.shape[0], (x, np.ascontiguousarray(lora_a, dtype=_F32), _slots(slots), out))
    return out


def lora_expand(t: np.ndarray, lora_b: np.ndarray, scale: np.ndarray, slots: np.ndarray, y: np.ndarray) -> np.ndarray:
    """reference.lora.lora_expand: y[i] += scale[slot] * B[slot] @ t[i] in place (y float32, C-contiguous)."""
    if y.dtype != _F32 or not y.flags.c_contiguous:
        raise ValueError(f"lora_expand: y must be C-contiguous float32, got {y.dtype} {y.flags.c_contiguous}")
    _run(_EXPAND, t.shape[0], (np.ascontiguousarray(t, dtype=_F32), np.ascontiguousarray(lora_b, dtype=_F32),
                               np.ascontiguousarray(scale, dtype=_F32), _slots(slots), y))
    return y
