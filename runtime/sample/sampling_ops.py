"""Array helpers of the sampler: row-wise log-sum-exp, top candidates, inverse-CDF draws, penalties.

Every function works on [B, V] arrays through `xp` (the numpy API subset CuPy also has); the sampler
(runtime/sample/sampler.py) strings them together.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np

from pagedserve.cupy_kernels.reference import ops
from ..sampling_params import SamplingParams

# A top_p-only row (no top_k) looks for its nucleus among its 64 most likely tokens, then its
# 1024 most likely, and sorts the whole row only when those hold less than top_p of the mass.
# With SmolLM2-135M logits at temperature <= 1 and top_p <= 0.95 the nucleus has a median of
# 2-10 tokens and at most ~600, so the first stages serve nearly every row.
NUCLEUS_CANDIDATES = (64, 1024)
# Height of the [_GROUPS, V / _GROUPS] grid a row is viewed as by the two-level helpers below.
# Reducing over the grid's rows is a cheap, vectorised pass in numpy (unlike reducing many short
# contiguous blocks), so the helpers replace a full-width argpartition or cumsum by one such pass
# plus work on a single column.
_GROUPS = 16


def _flat_keys(
    rows: Sequence[int], seqs: Sequence[Sequence[int]], vocab_size: int, what: str
) -> np.ndarray:
    """(row, token) pairs as int64 keys row * V + token, built on the host."""
    lens = [len(s) for s in seqs]
    total = sum(lens)
    toks = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=total)
    if total and (toks.min() < 0 or toks.max() >= vocab_size):
        bad = toks[(toks < 0) | (toks >= vocab_size)][0]
        raise ValueError(f"{what} contains token id {int(bad)} outside [0, {vocab_size}).")
    return np.repeat(np.asarray(rows, dtype=np.int64), lens) * vocab_size + toks


def _logsumexp_rows(x: Any, xp: Any, row_max: Any = None) -> Any:
    """log(sum(exp(x), axis=1)) for a [B, V] float32 array (ops.logsumexp_rows, for either array module)."""
    return ops.logsumexp_rows(x, row_max, xp)


def _top_candidates(x: Any, c: int, xp: Any) -> tuple[Any, Any]:
    """The c largest entries of each row: (token ids, values), largest first.

    Tied values come in an order fixed by the row's contents alone (selection and sorting work
    on each row independently), which is all batch invariance needs.
    """
    num_rows, vocab_size = x.shape
    if c >= vocab_size:
        ids = xp.argsort(-x, axis=1)
        return ids, xp.take_along_axis(x, ids, axis=1)
    if xp is not np:  # a device: CuPy's argpartition sorts whole rows; select without sorting V
        from .sampling_device import top_candidates

        return top_candidates(x, c, xp)
    if vocab_size % _GROUPS == 0 and c * _GROUPS * 8 <= vocab_size:
        ids = _top_ids_grouped(x, c, xp)
    else:
        # argpartition with kth = V - c puts the c largest (unordered) in the last c columns.
        ids = xp.argpartition(x, vocab_size - c, axis=1)[:, vocab_size - c :]
    vals = xp.take_along_axis(x, ids, axis=1)
    order = xp.argsort(-vals, axis=1)
    return xp.take_along_axis(ids, order, axis=1), xp.take_along_axis(vals, order, axis=1)


def _top_ids_grouped(x: Any, c: int, xp: Any) -> Any:
    """Ids of the c largest entries per row (unordered), for small c, in about two passes.

    Column j of the [_GROUPS, V / _GROUPS] grid holds tokens j, j + V/G, j + 2V/G, ... Each of
    the c largest entries lies in a column whose max is >= the c-th largest value, so all of them
    lie in the c columns with the largest maxima: pick those columns, then the c largest of
    their _GROUPS * c entries. About 4x faster than argpartition over whole rows for c <= ~100.
    """
    num_rows, vocab_size = x.shape
    num_cols = vocab_size // _GROUPS
    grid = x.reshape(num_rows, _GROUPS, num_cols)
    col_max = grid.max(axis=1)
    cols = xp.argpartition(col_max, num_cols - c, axis=1)[:, num_cols - c :]  # [R, c]
    rows_i = xp.arange(num_rows)[:, None, None]
    groups_i = xp.arange(_GROUPS)[None, :, None]
    sub = grid[rows_i, groups_i, cols[:, None, :]].reshape(num_rows, _GROUPS * c)
    p = xp.argpartition(sub, _GROUPS * c - c, axis=1)[:, _GROUPS * c - c :]
    # sub[:, g * c + i] is token g * num_cols + cols[:, i].
    return (p // c) * num_cols + xp.take_along_axis(cols, p % c, axis=1)


def _inverse_cdf(w: Any, u: Any, xp: Any) -> Any:
    """Column index per row drawn with probability w / w.sum(axis=1); u: uniforms in [0, 1).

    Columns with weight 0 are never chosen: running totals never decrease, so the first one to
    pass the target belongs to a column with weight.
    """
    width = w.shape[1]
    if width % _GROUPS == 0 and width >= _GROUPS * 256:
        return _inverse_cdf_grid(w, u, xp)
    cs = xp.cumsum(w, axis=1)
    total = cs[:, -1]
    return _first_above(cs, (u * total).astype(cs.dtype), xp)


def _first_above(cs: Any, target: Any, xp: Any) -> Any:
    """Per row, the first column where the running total cs exceeds target."""
    if xp is not np:  # a device: the same rule without reading `over` back to the host
        from .sampling_device import first_above

        return first_above(cs, target, xp)
    pos = (cs <= target[:, None]).sum(axis=1)
    # u < 1, but rounding can put the target at or past the total: then take the last column
    # with weight, the first where the running total reaches its final value.
    over = pos >= cs.shape[1]
    if bool(over.any()):
        pos[over] = xp.argmax(cs[over] >= cs[:, -1:][over], axis=1)
    return pos


def _inverse_cdf_grid(w: Any, u: Any, xp: Any) -> Any:
    """_inverse_cdf for wide rows without a full-width cumsum (the costliest pass on CPU).

    Any fixed order of the tokens gives a valid inverse-CDF draw, so walk the [_GROUPS, W/_GROUPS]
    grid column by column: pick the column from the running total of column sums, then the
    entry inside it.
    """
    num_rows, width = w.shape
    num_cols = width // _GROUPS
    grid = w.reshape(num_rows, _GROUPS, num_cols)
    col_cs = xp.cumsum(grid.sum(axis=1), axis=1)  # [R, num_cols]
    target = u * col_cs[:, -1]
    col = _first_above(col_cs, target.astype(col_cs.dtype), xp)
    rows_i = xp.arange(num_rows)
    before = xp.where(col > 0, col_cs[rows_i, xp.maximum(col - 1, 0)], 0)
    entries = grid[rows_i[:, None], xp.arange(_GROUPS)[None, :], col[:, None]]  # [R, _GROUPS]
    cs = xp.cumsum(entries, axis=1)
    # Rounding can leave the remainder a hair below 0; clamped, the draw still skips
    # zero-weight entries at the top of the column.
    rest = xp.maximum(target - before, 0).astype(cs.dtype)
    return _first_above(cs, rest, xp) * num_cols + col


def apply_penalties_and_bans(
    logits: Any,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    banned_token_ids: Sequence[Sequence[int]] | None = None,
    xp: Any = np,
) -> Any:
    """Penalties and bans of the module docstring, for [B, V] float32 ``logits``.

    Returns a new array when anything changes, else ``logits`` itself (never modified).
    """
    vocab_size = logits.shape[1]
    bias_rows = [b for b, p in enumerate(params) if p.logit_bias]
    rep_rows = [b for b, p in enumerate(params) if p.repetition_penalty != 1.0]
    pf_rows = [
        b
        for b, p in enumerate(params)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    ]
    ban_rows = (
        [b for b, ids in enumerate(banned_token_ids) if len(ids) > 0]
        if banned_token_ids is not None
        else []
    )
    if not (bias_rows or rep_rows or pf_rows or ban_rows):
        return logits
    out = logits.copy()

    if bias_rows:
        # OpenAI's logit_bias, first (as vLLM v1 does): added to the raw logit, so a repetition penalty then
        # scales the biased value. Keys are unique per row, so the fancy in-place addition is exact.
        keys = _flat_keys(bias_rows, [list(params[b].logit_bias) for b in bias_rows], vocab_size, "logit_bias")
        bias = np.fromiter((v for b in bias_rows for v in params[b].logit_bias.values()), np.float32, len(keys))
        r, t = xp.asarray(keys // vocab_size), xp.asarray(keys % vocab_size)
        out[r, t] += xp.asarray(bias)

    if rep_rows:
        # HF / vLLM: every token seen in the prompt or the output, once, whatever its count.
        keys = _flat_keys(
            [b for b in rep_rows for _ in range(2)],
            [s for b in rep_rows for s in (prompt_token_ids[b], output_token_ids[b])],
            vocab_size,
            "prompt_token_ids/output_token_ids",
        )
        keys = np.unique(keys)
        if keys.size:
            r, t = keys // vocab_size, keys % vocab_size
            penalty = np.array([p.repetition_penalty for p in params], np.float32)[r]
            r, t, penalty = xp.asarray(r), xp.asarray(t), xp.asarray(penalty)
            vals = out[r, t]
            # Divide positive logits, multiply negative ones: both make the token less likely.
            out[r, t] = xp.where(vals > 0, vals / penalty, vals * penalty)

    if pf_rows:
        # OpenAI / vLLM: over generated tokens only, not the prompt.
        keys = _flat_keys(
            pf_rows, [output_token_ids[b] for b in pf_rows], vocab_size, "output_token_ids"
        )
        keys, counts = np.unique(keys, return_counts=True)
        if keys.size:
            r, t = keys // vocab_size, keys % vocab_size
            freq = np.array([p.frequency_penalty for p in params], np.float64)[r]
            pres = np.array([p.presence_penalty for p in params], np.float64)[r]
            delta = (freq * counts + pres).astype(np.float32)
            r, t, delta = xp.asarray(r), xp.asarray(t), xp.asarray(delta)
            # (row, token) pairs are unique, so fancy in-place subtraction is exact.
            out[r, t] -= delta

    if ban_rows:
        keys = _flat_keys(
            ban_rows, [banned_token_ids[b] for b in ban_rows], vocab_size, "banned_token_ids"
        )
        r, t = xp.asarray(keys // vocab_size), xp.asarray(keys % vocab_size)
        out[r, t] = -np.inf
    return out




# Added to the logits through the mask: -inf + x = -inf and 0 + x = x, exactly. A gather from this two-entry
# table plus one add is ~5x faster on CPU than numpy's masked copyto or where over [B, V].
_MASK_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)


def apply_token_bitmask(logits: Any, rows: Any, bits: Any, xp: Any = np, copy: bool = True) -> Any:
    """``logits`` [B, V] with -inf wherever row ``rows[i]``'s bitmask ``bits[i]`` (int32 [R, ceil(V / 32)],
    bit j of word w = token 32 * w + j: llguidance's layout) has a 0; tokens past the mask's width are
    disallowed too. ``copy=False`` writes into ``logits`` (the caller's own array)."""
    num_rows, vocab_size = logits.shape
    words = bits.shape[1]
    if xp is np:
        # The int32 words' bytes in memory order, little-endian: bit k of byte m is token 8 * m + k.
        allowed = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), axis=1, bitorder="little")
    else:
        b = xp.asarray(bits)
        allowed = ((b[:, :, None] >> xp.arange(32, dtype=b.dtype)) & 1).reshape(b.shape[0], words * 32)
    width = min(vocab_size, words * 32)
    bias = xp.asarray(_MASK_BIAS).take(allowed[:, :width])  # [R, width] of -inf / 0
    rows = np.asarray(rows, dtype=np.int64)
    whole = rows.shape[0] == num_rows and bool((rows == np.arange(num_rows)).all())
    if whole and width == vocab_size:
        if copy:
            return logits + bias
        logits += bias
        return logits
    out = logits.copy() if copy else logits
    sub = out if whole else out[xp.asarray(rows)]
    sub[:, :width] += bias
    sub[:, width:] = -np.inf
    if not whole:
        out[xp.asarray(rows)] = sub
    return out
