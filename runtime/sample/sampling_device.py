"""The sampler's device path: no data-dependent host decisions, no full-vocabulary sorts.

On the GPU every `bool(...)`, `int(...)` or `.get()` of a device value waits for the whole queue of
work before it. The numpy path (sampler.py, sampling_ops.py) makes such decisions freely - which
nucleus stage serves a row, whether a rounding fix-up is needed - because they cost nothing on the
host. On a device the sampler instead reads back once per step (`fetch`: token ids, their logprobs
and any top logprobs packed into one float64 buffer) and replaces the decisions by fixed work:

- top-k selection for any k (CuPy's argpartition is a full argsort of the row, kth ignored):
  the k-th largest value is found by bisection on the float32 bit patterns (32 passes of
  "how many >= t" over [R, V]; exact, no sort), the k tokens are gathered with one cumsum and a
  scatter, and only those k are sorted.
- top-p without top-k: the nucleus cut-off is found the same way, by bisection on the value with
  "mass strictly below t <= (1 - top_p) * total", the rule the sorted formulation of sampler.py
  computes (the most likely token always kept, ties at the cut-off all kept), without sorting V.

Everything here works through `xp` (the numpy API subset CuPy has) and is tested with numpy as xp.
Row results depend only on the row (ties at the k-th value: lowest token id first), which keeps
seeded requests independent of their batch.

On CuPy arrays the random rows skip all of that: `sample_random_rows` draws every one of them in one launch of
the CUDA set's sort-free sampler (cupy_kernels/cuda/sampling.cu's sample_rows_kernel: temperature, top-k, top-p,
min-p by threshold searches, one CTA per row), top-k rows in value order as the host path draws them, the others
in token order. The functions above then serve only array modules without that kernel.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedserve.cupy_kernels.backend import to_host
from pagedserve.cupy_kernels.cuda.launch import is_cupy_array

from ..sampling_params import MAX_TEMPERATURE

_BISECTION_STEPS = 33  # a float32 key range spans < 2**33 integers: 33 halvings reach one value


def sortable_keys(x: Any, xp: Any) -> Any:
    """int32 keys ordered like the float32 values of x (-0.0 just below 0.0, -inf lowest)."""
    bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.int32)
    # Negative floats order backwards as integers: flip their magnitude bits (stays within int32).
    return xp.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits)


def kth_largest_key(keys: Any, k: int, xp: Any) -> Any:
    """Per row, the key of the k-th largest value (1 <= k <= V), by bisection: [R] int64."""
    lo = keys.min(axis=1).astype(xp.int64)
    hi = keys.max(axis=1).astype(xp.int64)
    for _ in range(_BISECTION_STEPS):  # invariant: count(keys >= lo) >= k, count(keys > hi) < k
        mid = lo + (hi - lo + 1) // 2
        enough = (keys >= mid[:, None]).sum(axis=1) >= k
        lo = xp.where(enough, mid, lo)
        hi = xp.where(enough, hi, mid - 1)
    return lo


def top_candidates(x: Any, c: int, xp: Any) -> tuple[Any, Any]:
    """The c largest entries of each row of x [R, V]: (token ids, values), largest first; ties at the
    c-th value keep the lowest token ids. No sort of V: bisection, one cumsum, one scatter."""
    num_rows, vocab_size = x.shape
    keys = sortable_keys(x, xp)
    t = kth_largest_key(keys, c, xp)[:, None]
    above = keys > t
    tied = keys == t
    room = c - above.sum(axis=1, keepdims=True)  # how many of the tied values fit
    keep = above | (tied & (xp.cumsum(tied, axis=1, dtype=xp.int32) <= room))
    slot = xp.where(keep, xp.cumsum(keep, axis=1, dtype=xp.int32) - 1, c)  # column c takes the dropped
    ids = xp.empty((num_rows, c + 1), dtype=xp.int64)
    rows = xp.broadcast_to(xp.arange(num_rows)[:, None], x.shape)
    cols = xp.broadcast_to(xp.arange(vocab_size)[None, :], x.shape)
    ids[rows, slot] = cols
    ids = ids[:, :c]
    vals = xp.take_along_axis(x, ids, axis=1)
    # Only the c candidates are sorted; stable, so ties stay in token order. CuPy's argsort is always
    # stable and (in some versions) takes no `kind`.
    order = xp.argsort(-vals, axis=1, kind="stable") if xp is np else xp.argsort(-vals, axis=1)
    return xp.take_along_axis(ids, order, axis=1), xp.take_along_axis(vals, order, axis=1)


def nucleus_mask(x: Any, top_p: Any, xp: Any) -> tuple[Any, Any]:
    """(keep [R, V] bool, w [R, V] = exp(x - row max)) for top-p over whole rows.

    keep = values >= t, t the largest value whose strictly smaller values hold at most (1 - top_p)
    of the mass: sampler._sample_nucleus_full_row's rule, found by bisection instead of a sort.
    """
    keys = sortable_keys(x, xp)
    row_max = x.max(axis=1, keepdims=True)
    w = xp.exp(x - row_max)
    budget = w.sum(axis=1) * (1 - top_p)
    lo = keys.min(axis=1).astype(xp.int64)  # mass below the smallest value is 0: within the budget
    hi = keys.max(axis=1).astype(xp.int64)  # never cut above the most likely token
    for _ in range(_BISECTION_STEPS):
        mid = lo + (hi - lo + 1) // 2
        fits = (w * (keys < mid[:, None])).sum(axis=1) <= budget
        lo = xp.where(fits, mid, lo)
        hi = xp.where(fits, hi, mid - 1)
    return keys >= lo[:, None], w


def first_above(cs: Any, target: Any, xp: Any) -> Any:
    """sampling_ops._first_above without its host-side branch: the rounding fix-up (a target at or past
    the row's total) is computed for every row and selected with `where`."""
    pos = (cs <= target[:, None]).sum(axis=1)
    last = xp.argmax(cs >= cs[:, -1:], axis=1)
    return xp.where(pos >= cs.shape[1], last, pos)


def fetch(parts: list[Any], xp: Any) -> list[np.ndarray]:
    """Copy several device arrays to the host in ONE transfer (one sync): packed as float64 (token ids
    below 2**53 are exact), split and reshaped on the host."""
    if not parts:
        return []
    flat = xp.concatenate([xp.ravel(p).astype(xp.float64) for p in parts])
    host = to_host(flat)
    out, at = [], 0
    for p in parts:
        n = int(np.prod(p.shape))
        out.append(host[at : at + n].reshape(p.shape))
        at += n
    return out


def sample_random_rows(processed: Any, params: Any, rows: list[int], u: np.ndarray, tokens: Any, xp: Any) -> bool:
    """Draw tokens[rows] with the CUDA sampler kernel when `processed` is a CuPy array: one launch for every random
    row whatever its settings, each row's parameters and uniform u[b] uploaded together. False (nothing done)
    for any other array, whose rows go through the xp path."""
    if not is_cupy_array(processed):
        return False
    from pagedserve.cupy_kernels.cuda import ops as cuda_ops

    vocab = processed.shape[1]
    top_k = np.array([params[b].top_k if 0 < params[b].top_k < vocab else 0 for b in rows], np.int32)
    args = (np.array([min(params[b].temperature, MAX_TEMPERATURE) for b in rows], np.float32), top_k,
            np.array([params[b].top_p for b in rows], np.float32),
            np.array([params[b].min_p for b in rows], np.float32), u[np.asarray(rows, dtype=np.int64)],
            (top_k > 0).astype(np.int32))
    if len(rows) == processed.shape[0]:
        cuda_ops.sample_rows(processed, *args, out=tokens)
    else:
        rows_x = xp.asarray(np.asarray(rows, dtype=np.int64))
        tokens[rows_x] = cuda_ops.sample_rows(processed[rows_x], *args)
    return True
