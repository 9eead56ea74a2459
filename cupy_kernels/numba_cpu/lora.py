"""numba versions of the batched LoRA ops (reference/lora.py): one launch.py item a row, base rows skipped.

A row's shrink is its slot's rank rows of A dotted with x; its expand adds, for each rank row r of its slot,
scale * t[r] times B's row r (B is [R, out]: an axpy over the contiguous outputs, four rank rows at a time, so
LLVM keeps y's row in vector registers' reach and each B row is streamed once). `ranks` ([L, parts] int32, the
rank each slot has in each part of a fused projection; `bounds` the parts' output columns) lets a row skip the
zero padding past its adapter's rank and the parts its adapter does not target (a q/v-only adapter does no
work for k): the padding is zeros, so the sums are the reference's. Every row is computed from that row alone
(batch invariance), by the same compiled item on whichever thread; rows whose slot is -1 return at once, so a
step's base rows cost one load each. Decode steps (few rows) run on the calling thread, as the elementwise
kernels do (ops.py).
"""

from __future__ import annotations

import numpy as np

from .launch import array1, array2, array3, item_address, run_parts
from .setup import JIT, apply_threads, numba

# Rows from which the LoRA items share numba's threads. A row's items are a few microseconds of work (rank x
# (in + out) FMAs); at 64 rows on the 2-core VM a parallel launch cost ~0.3 ms against 0.04-0.2 ms for the
# whole serial call (contended host, a micro-benchmark of SmolLM2's shapes, 4 adapters of rank 16).
PARALLEL_MIN_ROWS = 256
_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)
_f32, _i32 = np.float32, np.int32  # (the dtype argument of launch.array1 .. array3 inside the items)


def _shrink_row(i, words):
    """Row i of lora_shrink (words: x [T, in], lora_a [L, R, in], slots [T], ranks [L, P] int32, out [T, R])."""
    slots = array1(words, 7, _i32)
    s = slots[i]
    if s < 0:
        return
    x, a, ranks, out = array2(words, 0, _f32), array3(words, 3, _f32), array2(words, 9, _i32), array2(words, 12, _f32)
    n_in = x.shape[1]
    parts = ranks.shape[1]
    per_part = a.shape[1] // parts
    xr = x[i]
    for p in range(parts):
        r0 = p * per_part
        for r in range(r0, r0 + min(ranks[s, p], per_part)):
            ar = a[s, r]
            acc = np.float32(0.0)
            for k in range(n_in):
                acc += ar[k] * xr[k]
            out[i, r] = acc


def _expand_row(i, words):
    """Row i of lora_expand (words: t [T, R], lora_b [L, R, out], scale [L], slots [T], ranks [L, P] int32,
    bounds [P + 1] int32, y [T, out])."""
    slots = array1(words, 9, _i32)
    s = slots[i]
    if s < 0:
        return
    t, b, scale = array2(words, 0, _f32), array3(words, 3, _f32), array1(words, 7, _f32)
    ranks, bounds, y = array2(words, 11, _i32), array1(words, 14, _i32), array2(words, 16, _f32)
    sc = scale[s]
    parts = ranks.shape[1]
    per_part = b.shape[1] // parts
    for p in range(parts):
        o0, o1 = bounds[p], bounds[p + 1]
        yr = y[i, o0:o1]  # (slices indexed from 0: no negative-index wraparound, so LLVM vectorizes the loops)
        n = yr.shape[0]
        r, r_end = p * per_part, p * per_part + min(ranks[s, p], per_part)
        while r + 4 <= r_end:
            c0, c1, c2, c3 = sc * t[i, r], sc * t[i, r + 1], sc * t[i, r + 2], sc * t[i, r + 3]
            b0, b1, b2, b3 = b[s, r, o0:o1], b[s, r + 1, o0:o1], b[s, r + 2, o0:o1], b[s, r + 3, o0:o1]
            for o in range(n):
                yr[o] += c0 * b0[o] + c1 * b1[o] + c2 * b2[o] + c3 * b3[o]
            r += 4
        while r < r_end:
            c0, b0 = sc * t[i, r], b[s, r, o0:o1]
            for o in range(n):
                yr[o] += c0 * b0[o]
            r += 1


_SHRINK = numba.njit(**JIT)(_shrink_row)
_EXPAND = numba.njit(**JIT)(_expand_row)


def _run(item, count: int, parts: tuple) -> None:
    parallel = count >= PARALLEL_MIN_ROWS
    if parallel:
        apply_threads(parallel=True)
    run_parts(item_address(item), count, parts, serial=not parallel)


def _slots(slots) -> np.ndarray:
    return np.ascontiguousarray(slots, dtype=_I32)


def _ranks(ranks, slots_count: int, rank: int) -> np.ndarray:
    """ranks as [L, P] int32 (None: one part of the full rank R in every slot)."""
    if ranks is None:
        return np.full((slots_count, 1), rank, dtype=_I32)
    return np.ascontiguousarray(ranks, dtype=_I32)


def lora_shrink(x: np.ndarray, lora_a: np.ndarray, slots: np.ndarray, ranks=None) -> np.ndarray:
    """reference.lora.lora_shrink: t [T, R] = A[slot] @ x per row (zero for base rows and past each part's rank)."""
    x = np.ascontiguousarray(x, dtype=_F32)
    out = np.zeros((x.shape[0], lora_a.shape[1]), dtype=_F32)
    _run(_SHRINK, x.shape[0], (x, np.ascontiguousarray(lora_a, dtype=_F32), _slots(slots),
                               _ranks(ranks, lora_a.shape[0], lora_a.shape[1]), out))
    return out


def lora_expand(t: np.ndarray, lora_b: np.ndarray, scale: np.ndarray, slots: np.ndarray, y: np.ndarray,
                ranks=None, bounds=None) -> np.ndarray:
    """reference.lora.lora_expand: y[i] += scale[slot] * t[i] @ B[slot] in place (y float32, C-contiguous)."""
    if y.dtype != _F32 or not y.flags.c_contiguous:
        raise ValueError(f"lora_expand: y must be C-contiguous float32, got {y.dtype} {y.flags.c_contiguous}")
    ranks = _ranks(ranks, lora_b.shape[0], lora_b.shape[1])
    bounds = np.array([0, lora_b.shape[2]], dtype=_I32) if bounds is None else np.ascontiguousarray(bounds, _I32)
    if bounds.shape != (ranks.shape[1] + 1,):
        raise ValueError(f"lora_expand: bounds must be [{ranks.shape[1] + 1}] for ranks of {ranks.shape}")
    _run(_EXPAND, t.shape[0], (np.ascontiguousarray(t, dtype=_F32), np.ascontiguousarray(lora_b, dtype=_F32),
                               np.ascontiguousarray(scale, dtype=_F32), _slots(slots), ranks, bounds, y))
    return y
