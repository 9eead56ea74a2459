"""numpy reference of cuda/sampling.cu's sample_rows_kernel: the same rules, found the same way.

One token per row of logits [B, V]: y = logits / temperature (float32), key = y's bits made order-preserving,
w = exp(y - max y); then
  top-k (0 < k < V): t_k = the largest key with count(key >= t_k) >= k; keys > t_k kept, and of the keys
    == t_k the lowest token ids, k in all;
  top-p (top_p < 1), over the top-k set S: t_p = the largest key whose strictly smaller keys in S hold at
    most (1 - top_p) of S's mass; keys >= t_p kept (ties at the cut all kept, the top token always);
  min-p (min_p > 0): w >= min_p;
  the draw: the first token whose running kept mass exceeds u * W (W: the kept mass), in token order, or for a
    row with by_value set in value order (largest first, ties lowest id first: the host sampler's order for
    top-k rows); if rounding puts u * W at W, the last kept token with weight.
Each threshold is found by the kernel's k-ary search (SAMPLE_PIVOTS pivots a pass, no sort); the masses
here are float64 sums, the kernel's float32 sums in a fixed tree, so the two can differ only where a
mass lands within rounding of a cut. `kept_probabilities` gives the distribution the rules define, by
sorting, for tests.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

SAMPLE_PIVOTS = 16  # PS_SP in sampling.cu


def sort_keys(y: np.ndarray) -> np.ndarray:
    """int64 keys ordered like the float32 values (-0.0 just below 0.0, -inf lowest)."""
    bits = np.ascontiguousarray(y, dtype=np.float32).view(np.int32)
    return np.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits).astype(np.int64)


def kary_search(lo: int, hi: int, ok: Callable[[np.ndarray], np.ndarray], pivots: int = SAMPLE_PIVOTS) -> int:
    """The largest t in [lo, hi] with ok(t) (ok(lo) true, ok monotone), `pivots` candidates a pass, as the
    kernel's ps_search picks them. ok takes an array of pivots and answers for each."""
    while lo < hi:
        span = hi - lo
        piv = lo + (span * np.arange(1, pivots + 1, dtype=np.int64) + pivots - 1) // pivots
        good = ok(piv)
        new_lo = max([lo] + [int(p) for p, g in zip(piv, good) if g])
        new_hi = min([hi] + [int(p) - 1 for p, g in zip(piv, good) if not g])
        lo, hi = new_lo, new_hi
    return lo


def _row_masks(y: np.ndarray, top_k: int, top_p: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(kept [V] bool, w [V] float64) of one row under the rules above."""
    vocab = y.shape[0]
    keys = sort_keys(y)
    m = y.max()
    w = np.exp((y - m).astype(np.float64))
    ids = np.arange(vocab)
    kmin, kmax = int(keys.min()), int(keys.max())
    key_k, i_tie = kmin, vocab - 1
    if 0 < top_k < vocab:
        key_k = kary_search(kmin, kmax, lambda p: (keys[None, :] >= p[:, None]).sum(axis=1) >= top_k)
        room = top_k - int((keys > key_k).sum())
        tied = keys == key_k
        if tied.sum() > room:
            i_tie = kary_search(-1, vocab - 1, lambda p: ((tied[None, :] & (ids[None, :] <= p[:, None])).sum(axis=1)
                                                          < room)) + 1
    in_k = (keys > key_k) | ((keys == key_k) & (ids <= i_tie))
    key_p = kmin
    if top_p < 1.0:
        wk = np.where(in_k, w, 0.0)
        budget = (1.0 - np.float32(top_p)) * wk.sum()
        key_p = kary_search(kmin, kmax, lambda p: (wk[None, :] * (keys[None, :] < p[:, None])).sum(axis=1) <= budget)
    kept = in_k & (keys >= key_p)
    if min_p > 0:
        kept &= w >= np.float32(min_p)
    return kept, w


def sample_rows(logits: np.ndarray, temperature, top_k, top_p, min_p, uniforms, by_value=None) -> np.ndarray:
    """Token ids int64 [B]: sample_rows_kernel's result for the same inputs (up to rounding at a cut)."""
    logits = np.asarray(logits)
    out = np.empty(logits.shape[0], dtype=np.int64)
    for b in range(logits.shape[0]):
        y = logits[b].astype(np.float32) / np.float32(temperature[b])
        kept, w = _row_masks(y, int(top_k[b]), float(top_p[b]), float(min_p[b]))
        kw = np.where(kept, w, 0.0)
        target = float(uniforms[b]) * kw.sum()
        vocab = y.shape[0]
        if by_value is not None and by_value[b]:
            order = np.lexsort((np.arange(vocab), -y))  # value descending, then token id ascending
            cs = np.cumsum(kw[order])
            at = int(np.searchsorted(cs, target, side="right"))
            out[b] = order[at] if at < vocab and kw[order[at]] > 0 else order[np.flatnonzero(kw[order] > 0).max()]
            continue
        cs = np.cumsum(kw)
        token = kary_search(-1, vocab - 1, lambda p: cs[p.clip(0)] * (p >= 0) <= target) + 1
        out[b] = token if token < vocab else int(np.flatnonzero(kept & (w > 0)).max())
    return out


def kept_probabilities(logits_row: np.ndarray, temperature: float, top_k: int, top_p: float,
                       min_p: float) -> np.ndarray:
    """The distribution the rules define for one row, [V] float64, computed by sorting (for tests)."""
    y = np.asarray(logits_row).astype(np.float32) / np.float32(temperature)
    vocab = y.shape[0]
    w = np.exp((y - y.max()).astype(np.float64))
    order = np.lexsort((np.arange(vocab), -y))  # value descending, then token id ascending
    keep = np.zeros(vocab, bool)
    keep[order[:top_k] if 0 < top_k < vocab else order] = True
    if top_p < 1.0:
        wk = np.where(keep, w, 0.0)
        budget = (1.0 - np.float32(top_p)) * wk.sum()
        asc = np.sort(np.unique(y[keep]))
        below = np.array([wk[y < v].sum() for v in asc])
        cut = asc[below <= budget].max()
        keep &= y >= cut
    if min_p > 0:
        keep &= w >= np.float32(min_p)
    p = np.where(keep, w, 0.0)
    return p / p.sum()
