"""Batched sampler: one row of logits per request -> one token per request.

Pipeline for every step (row ``b`` belongs to request ``b``)::

    raw logits [B, V] --+--> log_softmax ------------------------------> logprobs, top_logprobs
                        |
                        +--> repetition penalty (prompt + output tokens)
                             presence / frequency penalty (output tokens only)
                             banned ids -> -inf   (the engine's min_tokens eos ban, ...)
                               |
                               +--> greedy rows: argmax
                               +--> random rows: / temperature -> top_k -> top_p -> min_p
                                                 -> inverse-CDF draw with one uniform per row

Logprobs are those of the model's RAW distribution (log_softmax of the unprocessed logits), as
vLLM v1 returns by default (``logprobs_mode="raw_logprobs"``): penalties, temperature and
truncation change which token is picked, not the reported probabilities.

Truncation order is Hugging Face's (top_k, then top_p, then min_p); vLLM v1 applies min_p before
top_k/top_p. top_p is applied to the distribution already renormalised over the top_k tokens and
always keeps the most likely token; min_p keeps tokens with p >= min_p * p_max. top_k keeps
exactly k tokens (ties at the k-th value are broken in an order fixed by the row's values).

Randomness. Each random row consumes exactly one uniform double per step: from its own
``np.random.Generator`` when it has one (seeded requests), else from the sampler's shared generator
(drawn in row order). The token is the first one, in a fixed order, whose running total of
weights exceeds ``u * total``. Every other computation on a row depends only on that row and its
own parameters (rows are grouped by their own settings, never by a batch-wide maximum), so a
seeded request yields the same tokens whatever else is in the batch.

Array backend: everything on [B, V] arrays goes through ``xp`` (the numpy API subset CuPy has);
token-id bookkeeping (penalty and ban indices, uniforms) is built on the host with numpy and moved
over as small index arrays. Results come back to the host as numpy.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from pagedserve.runtime.sampling_params import SamplingParams, SamplingType

# A top_p-only row (no top_k) looks for its nucleus among its 64 most likely tokens, then its
# 1024 most likely, and sorts the whole row only when those hold less than top_p of the mass.
# With SmolLM2-135M logits at temperature <= 1 and top_p <= 0.95 the nucleus has a median of
# 2-10 tokens and at most ~600, so the first stages serve nearly every row.
NUCLEUS_CANDIDATES = (64, 1024)
# Rows per chunk for full-vocab temporaries on CPU: a few rows of V float32 stay in L2.
_CPU_ROW_CHUNK = 4
# Height of the [_GROUPS, V / _GROUPS] grid a row is viewed as by the two-level helpers below.
# Reducing over the grid's rows is a cheap, vectorised pass in numpy (unlike reducing many short
# contiguous blocks), so the helpers replace a full-width argpartition or cumsum by one such pass
# plus work on a single column.
_GROUPS = 16


@dataclass
class SamplerOutput:
    token_ids: np.ndarray  # int64 [B]
    logprobs: np.ndarray  # float32 [B]: the chosen token's raw logprob
    # Per row: (token_id, logprob) of the `logprobs` most likely raw tokens, most likely first;
    # [] for logprobs=0, None for rows that did not ask.
    top_logprobs: list[list[tuple[int, float]] | None]


def _to_host(a: Any) -> np.ndarray:
    # CuPy arrays have .get(); numpy arrays do not.
    return a.get() if hasattr(a, "get") else np.asarray(a)


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
    """log(sum(exp(x), axis=1)) for a [B, V] float32 array, computed stably.

    row_max: x.max(axis=1) when the caller already has it (saves a pass).
    """
    m = x.max(axis=1) if row_max is None else row_max
    s = xp.empty_like(m)
    num_rows = x.shape[0]
    chunk = _CPU_ROW_CHUNK if xp is np else max(num_rows, 1)
    buf = xp.empty((min(chunk, num_rows), x.shape[1]), dtype=x.dtype)
    for start in range(0, num_rows, chunk):
        stop = min(start + chunk, num_rows)
        b = buf[: stop - start]
        xp.subtract(x[start:stop], m[start:stop, None], out=b)
        xp.exp(b, out=b)
        s[start:stop] = b.sum(axis=1)
    return m + xp.log(s)


def _top_candidates(x: Any, c: int, xp: Any) -> tuple[Any, Any]:
    """The c largest entries of each row: (token ids, values), largest first.

    Tied values come in an order fixed by the row's contents alone (selection and sorting work
    on each row independently), which is all batch invariance needs.
    """
    num_rows, vocab_size = x.shape
    if c >= vocab_size:
        ids = xp.argsort(-x, axis=1)
        return ids, xp.take_along_axis(x, ids, axis=1)
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
    if not (rep_rows or pf_rows or ban_rows):
        return logits
    out = logits.copy()

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


class Sampler:
    """Turns a [B, V] batch of logits into one token per row; see the module docstring."""

    def __init__(self, seed: int | None = None) -> None:
        # Shared by every row that has no generator of its own (unseeded requests).
        self.generator = np.random.default_rng(seed)

    def __call__(
        self,
        logits: Any,
        params: Sequence[SamplingParams],
        generators: Sequence[np.random.Generator | None],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        xp: Any = np,
        banned_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplerOutput:
        logits = xp.asarray(logits, dtype=xp.float32)
        if logits.ndim != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}.")
        num_rows, vocab_size = logits.shape
        for name, seq in (
            ("params", params),
            ("generators", generators),
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
        ):
            if len(seq) != num_rows:
                raise ValueError(f"{name} has {len(seq)} rows, logits has {num_rows}.")
        if banned_token_ids is not None and len(banned_token_ids) != num_rows:
            raise ValueError(
                f"banned_token_ids has {len(banned_token_ids)} rows, logits has {num_rows}."
            )
        if num_rows == 0:
            return SamplerOutput(np.zeros(0, np.int64), np.zeros(0, np.float32), [])

        processed = apply_penalties_and_bans(
            logits, params, prompt_token_ids, output_token_ids, banned_token_ids, xp
        )

        greedy_rows = [b for b, p in enumerate(params) if p.sampling_type == SamplingType.GREEDY]
        random_rows = [b for b, p in enumerate(params) if p.sampling_type != SamplingType.GREEDY]
        tokens = xp.empty(num_rows, dtype=xp.int64)
        if greedy_rows:
            if len(greedy_rows) == num_rows:
                tokens[:] = xp.argmax(processed, axis=1)
            else:
                g = xp.asarray(np.asarray(greedy_rows, dtype=np.int64))
                tokens[g] = xp.argmax(processed[g], axis=1)
        if random_rows:
            self._sample_random(processed, params, generators, random_rows, tokens, xp)

        # All-greedy on untouched logits (the common case): the argmax already located the max.
        row_max = None
        if not random_rows and processed is logits:
            row_max = logits[xp.arange(num_rows), tokens]
        lse = _logsumexp_rows(logits, xp, row_max)
        chosen = logits[xp.arange(num_rows), tokens] - lse
        top = self._top_logprobs(logits, lse, params, xp)
        return SamplerOutput(
            token_ids=_to_host(tokens).astype(np.int64, copy=False),
            logprobs=_to_host(chosen).astype(np.float32, copy=False),
            top_logprobs=top,
        )

    def _sample_random(
        self,
        processed: Any,
        params: Sequence[SamplingParams],
        generators: Sequence[np.random.Generator | None],
        random_rows: list[int],
        tokens: Any,
        xp: Any,
    ) -> None:
        num_rows, vocab_size = processed.shape
        # One uniform per random row: the row's own generator, else the shared one in row order.
        u = np.empty(num_rows, dtype=np.float64)
        unseeded = []
        for b in random_rows:
            gen = generators[b]
            if gen is not None:
                u[b] = gen.random()
            elif params[b].seed is not None:
                raise ValueError(
                    f"row {b} has seed={params[b].seed} but no generator; the engine must pass "
                    "np.random.default_rng(seed) for seeded requests."
                )
            else:
                unseeded.append(b)
        if unseeded:
            u[unseeded] = self.generator.random(len(unseeded))

        # Group rows by their own truncation settings only (never a batch-wide maximum), so a
        # row's result does not depend on its neighbours.
        groups: dict[tuple[str, int], list[int]] = defaultdict(list)
        for b in random_rows:
            p = params[b]
            k = p.top_k if 0 < p.top_k < vocab_size else 0
            if k:
                groups[("top_k", k)].append(b)
            elif p.top_p < 1.0:
                groups[("top_p", 0)].append(b)
            else:
                groups[("full", 0)].append(b)

        for (kind, k), rows in groups.items():
            rows_h = np.asarray(rows, dtype=np.int64)
            rows_x = xp.asarray(rows_h)
            temp = xp.asarray(np.array([params[b].temperature for b in rows], np.float32))
            top_p = xp.asarray(np.array([params[b].top_p for b in rows], np.float32))
            min_p = xp.asarray(np.array([params[b].min_p for b in rows], np.float32))
            any_top_p = any(params[b].top_p < 1.0 for b in rows)
            any_min_p = any(params[b].min_p > 0.0 for b in rows)
            group_u = xp.asarray(u[rows_h])
            # Both branches give a fresh array, which the helpers below may modify in place.
            if len(rows) == num_rows:
                scaled = processed / temp[:, None]
            else:
                scaled = processed[rows_x]
                scaled /= temp[:, None]

            if kind == "full":
                tokens[rows_x] = self._sample_full(scaled, min_p, any_min_p, group_u, xp)
            elif kind == "top_k":
                ids, vals = _top_candidates(scaled, k, xp)
                w = xp.exp(vals - vals[:, :1])
                tokens[rows_x] = self._sample_candidates(
                    ids, w, w.sum(axis=1), top_p, any_top_p, min_p, any_min_p, group_u, xp
                )
            else:
                tokens[rows_x] = self._sample_nucleus(
                    scaled, top_p, min_p, any_min_p, group_u, xp
                )

    @staticmethod
    def _sample_full(scaled: Any, min_p: Any, any_min_p: bool, u: Any, xp: Any) -> Any:
        """No top_k/top_p: draw from the whole (min_p-masked) distribution."""
        w = scaled  # a private copy: exponentiate in place
        xp.subtract(w, w.max(axis=1, keepdims=True), out=w)
        xp.exp(w, out=w)
        if any_min_p:
            # The most likely token has weight exp(0) = 1, so min_p * p_max is min_p itself.
            w *= w >= min_p[:, None]
        return _inverse_cdf(w, u, xp)

    @staticmethod
    def _sample_candidates(
        ids: Any,
        w: Any,
        total: Any,
        top_p: Any,
        any_top_p: bool,
        min_p: Any,
        any_min_p: bool,
        u: Any,
        xp: Any,
    ) -> Any:
        """Draw among candidates sorted most likely first.

        w: their weights relative to the most likely token (so w[:, 0] == 1); total: the mass
        top_p is measured against, on the same scale.
        """
        if any_top_p:
            probs = w / total[:, None]
            # Keep a token while the mass of the more likely ones is still below top_p; the
            # first token is always kept.
            before = xp.cumsum(probs, axis=1) - probs
            w = w * (before < top_p[:, None])
        if any_min_p:
            w = w * (w >= min_p[:, None])
        pos = _inverse_cdf(w, u, xp)
        return ids[xp.arange(ids.shape[0]), pos]

    def _sample_nucleus(
        self, scaled: Any, top_p: Any, min_p: Any, any_min_p: bool, u: Any, xp: Any
    ) -> Any:
        """top_p without top_k: look for the nucleus among the top NUCLEUS_CANDIDATES[0] tokens,
        then among the top NUCLEUS_CANDIDATES[1] for rows where that was not enough, then in the
        whole row. Which stage serves a row depends only on that row."""
        vocab_size = scaled.shape[1]
        vals_max = scaled.max(axis=1)
        # The whole row's mass relative to its most likely token (the scale of w below).
        total = xp.exp(_logsumexp_rows(scaled, xp) - vals_max)
        out = xp.empty(scaled.shape[0], dtype=xp.int64)
        todo = np.arange(scaled.shape[0])
        for c in NUCLEUS_CANDIDATES:
            if c >= vocab_size or todo.size == 0:
                break
            t = xp.asarray(todo)
            sub = scaled if todo.size == scaled.shape[0] else scaled[t]
            ids, vals = _top_candidates(sub, c, xp)
            w = xp.exp(vals - vals[:, :1])
            covered = _to_host(w.sum(axis=1) >= top_p[t] * total[t])
            if covered.any():
                k = xp.asarray(np.flatnonzero(covered))
                out[t[k]] = self._sample_candidates(
                    ids[k], w[k], total[t][k], top_p[t][k], True, min_p[t][k], any_min_p,
                    u[t][k], xp,
                )
            todo = todo[~covered]
        if todo.size:
            t = xp.asarray(todo)
            out[t] = self._sample_nucleus_full_row(
                scaled[t], top_p[t], min_p[t], any_min_p, u[t], xp
            )
        return out

    @staticmethod
    def _sample_nucleus_full_row(
        x: Any, top_p: Any, min_p: Any, any_min_p: bool, u: Any, xp: Any
    ) -> Any:
        """top_p over whole rows: find the cut-off value from the sorted values (a value sort is
        several times cheaper than an argsort), then draw, in token order, among the tokens at or
        above it. Tokens tied with the cut-off value are all kept."""
        num_rows, vocab_size = x.shape
        asc = xp.sort(x, axis=1)
        row_max = asc[:, -1:]
        cs = xp.cumsum(xp.exp(asc - row_max), axis=1)
        # Ascending, a token is dropped while the tokens at or below it hold at most 1 - top_p of
        # the mass (Hugging Face's formulation). The most likely token is always kept; the clamp
        # covers a top_p so small that 1 - top_p rounds to 1.
        num_drop = (cs <= cs[:, -1:] * (1 - top_p[:, None])).sum(axis=1)
        cutoff = asc[xp.arange(num_rows), xp.minimum(num_drop, vocab_size - 1)]
        keep = x >= cutoff[:, None]
        w = x  # a private copy (fancy-indexed): exponentiate in place
        xp.subtract(w, row_max, out=w)
        xp.exp(w, out=w)
        w *= keep
        if any_min_p:
            w *= w >= min_p[:, None]
        return _inverse_cdf(w, u, xp)

    @staticmethod
    def _top_logprobs(
        logits: Any, lse: Any, params: Sequence[SamplingParams], xp: Any
    ) -> list[list[tuple[int, float]] | None]:
        out: list[list[tuple[int, float]] | None] = [None] * len(params)
        by_n: dict[int, list[int]] = defaultdict(list)
        for b, p in enumerate(params):
            if p.logprobs is not None:
                by_n[p.logprobs].append(b)
        for n, rows in by_n.items():
            if n == 0:
                for b in rows:
                    out[b] = []
                continue
            if len(rows) == len(params):
                sub, sub_lse = logits, lse
            else:
                rows_x = xp.asarray(np.asarray(rows, dtype=np.int64))
                sub, sub_lse = logits[rows_x], lse[rows_x]
            ids, vals = _top_candidates(sub, n, xp)
            lp = _to_host(vals - sub_lse[:, None])
            ids_h = _to_host(ids)
            for i, b in enumerate(rows):
                out[b] = [(int(t), float(v)) for t, v in zip(ids_h[i], lp[i])]
        return out
