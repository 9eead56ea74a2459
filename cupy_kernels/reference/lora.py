"""Batched LoRA (Punica's shrink and expand), the numpy reference of every kernel set's lora ops.

A step's T rows each carry an adapter slot (-1: the base model, no LoRA). The adapters' weights are stacked
per slot, zero-padded to the largest rank R, so one call serves every adapter of the step:

    lora_a  [L, R, in]     slot s's A (rows past its rank are zero)
    lora_b  [L, R, out]    slot s's B transposed (rows past its rank are zero): an expand streams B's rows
    scale   [L] float32    slot s's lora_alpha / r (or / sqrt(r), rsLoRA)

    shrink:  t[i]  = A[slot[i]] @ x[i]                 [T, R]   (rows with slot -1: 0, never computed)
    expand:  y[i] += scale[slot[i]] * t[i] @ B[slot[i]]         (rows with slot -1: untouched)

A fused projection's slot holds its parts side by side (models/lora.py); `ranks` [L, P] (each slot's rank in
each part) and `bounds` [P + 1] (the parts' output columns) tell a compiled set which blocks are zero, to skip
them. The reference multiplies the zeros: the same sums.

Two forms of the same math: gathered per row (decode steps: few rows, each its own A), and segmented over
runs of rows with one slot (prefill chunks: a run is one GEMM against one A). Both give each row the same
sums in the same order up to BLAS's blocking, so the choice is made by size alone.
"""

from __future__ import annotations

import numpy as np

# Gathered A rows [n, R, in] above this many floats: segmented instead (a long prefill would gather MBs).
GATHER_MAX_FLOATS = 1 << 20


def _runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, slot) of each run of equal slots that is not -1."""
    if slots.size == 0:
        return []
    edges = np.flatnonzero(np.diff(slots)) + 1
    starts = np.concatenate(([0], edges))
    ends = np.concatenate((edges, [slots.size]))
    return [(int(a), int(b), int(slots[a])) for a, b in zip(starts, ends) if slots[a] >= 0]


def lora_shrink(x: np.ndarray, lora_a: np.ndarray, slots: np.ndarray, ranks=None) -> np.ndarray:
    """t [T, R] = A[slot] @ x per row, float32; zero for base rows."""
    slots = np.asarray(slots)
    t = np.zeros((x.shape[0], lora_a.shape[1]), dtype=np.float32)
    rows = np.flatnonzero(slots >= 0)
    if rows.size == 0:
        return t
    if rows.size * lora_a.shape[1] * lora_a.shape[2] <= GATHER_MAX_FLOATS:
        t[rows] = np.einsum("nri,ni->nr", lora_a[slots[rows]], x[rows].astype(np.float32), optimize=False)
    else:
        for a, b, s in _runs(slots):
            t[a:b] = x[a:b].astype(np.float32) @ lora_a[s].T
    return t


def lora_expand(t: np.ndarray, lora_b: np.ndarray, scale: np.ndarray, slots: np.ndarray, y: np.ndarray,
                ranks=None, bounds=None) -> np.ndarray:
    """y[i] += scale[slot] * t[i] @ B[slot] in place for rows with a slot; returns y."""
    slots = np.asarray(slots)
    rows = np.flatnonzero(slots >= 0)
    if rows.size == 0:
        return y
    if rows.size * lora_b.shape[1] * lora_b.shape[2] <= GATHER_MAX_FLOATS:
        d = np.einsum("nro,nr->no", lora_b[slots[rows]], t[rows], optimize=False) * scale[slots[rows], None]
        y[rows] += d.astype(y.dtype, copy=False)
    else:
        for a, b, s in _runs(slots):
            y[a:b] += ((t[a:b] @ lora_b[s]) * scale[s]).astype(y.dtype, copy=False)
    return y
