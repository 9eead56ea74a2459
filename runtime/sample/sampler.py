"""Batched sampler: one row of logits per request -> one token per request.

Pipeline for every step (row ``b`` belongs to request ``b``)::

    raw logits [B, V] --+--> log_softmax ------------------------------> logprobs, top_logprobs
                        |
                        +--> logit_bias (added to chosen ids' logits)
                             repetition penalty (prompt + output tokens)
                             presence / frequency penalty (output tokens only)
                             banned ids -> -inf   (the engine's min_tokens eos ban, ...)
                             grammar bitmask: disallowed ids -> -inf   (structured outputs)
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
over as small index arrays. Results come back to the host as numpy. On a device (any ``xp`` but
numpy) the step reads back exactly once - token ids, logprobs and top logprobs in one transfer - and
top-k / top-p select without sorting whole rows (runtime/sample/sampling_device.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from pagedserve.cupy_kernels.backend import to_host
from ..sampling_params import MAX_TEMPERATURE, SamplingParams, SamplingType

from . import sampling_device
from .sampling_ops import (NUCLEUS_CANDIDATES, _inverse_cdf, _logsumexp_rows, _top_candidates, apply_penalties_and_bans,
                           apply_token_bitmask)

@dataclass
class SamplerOutput:
    token_ids: np.ndarray  # int64 [B]
    logprobs: np.ndarray  # float32 [B]: the chosen token's raw logprob
    # Per row: (token_id, logprob) of the `logprobs` most likely raw tokens, most likely first;
    # [] for logprobs=0, None for rows that did not ask.
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Turns a [B, V] batch of logits into one token per row; see the module docstring."""

    def __init__(self, seed: int | None = None, logsumexp_rows: Any = None, argmax_rows: Any = None) -> None:
        # Shared by every row that has no generator of its own (unseeded requests).
        self.generator = np.random.default_rng(seed)
        # The backend's kernel for the chosen tokens' log-normaliser (backend.ops.logsumexp_rows: one
        # compiled pass per row with the numba set); None: ops.logsumexp_rows for whatever xp is passed.
        self.logsumexp_rows = logsumexp_rows
        # The backend's argmax over rows of host logits (backend.ops.argmax_rows(x, axis, lse_out): with lse_out
        # also the rows' log-sum-exp, as logsumexp_rows gives it); None: xp.argmax.
        self.argmax_rows = argmax_rows

    def __call__(
        self,
        logits: Any,
        params: Sequence[SamplingParams],
        generators: Sequence[np.random.Generator | None],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        xp: Any = np,
        banned_token_ids: Sequence[Sequence[int]] | None = None,
        grammar_bitmask: Any = None,
    ) -> SamplerOutput:
        """grammar_bitmask: a structured_output.GrammarBitmask (rows and their allowed-token bits) or None."""
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
        if grammar_bitmask is not None:
            processed = apply_token_bitmask(processed, grammar_bitmask.rows, grammar_bitmask.bits, xp,
                                            copy=processed is logits)

        greedy_rows = [b for b, p in enumerate(params) if p.sampling_type == SamplingType.GREEDY]
        random_rows = [b for b, p in enumerate(params) if p.sampling_type != SamplingType.GREEDY]
        tokens = xp.empty(num_rows, dtype=xp.int64)
        lse = None
        if greedy_rows:
            if len(greedy_rows) == num_rows and self.argmax_rows is not None and xp is np:
                # The backend's argmax; on untouched logits also their log-normaliser, from the same read.
                lse = np.empty(num_rows, np.float32) if processed is logits else None
                tokens[:] = self.argmax_rows(processed, axis=1, lse_out=lse)
            elif len(greedy_rows) == num_rows:
                tokens[:] = xp.argmax(processed, axis=1)
            else:
                g = xp.asarray(np.asarray(greedy_rows, dtype=np.int64))
                tokens[g] = xp.argmax(processed[g], axis=1)
        if random_rows:
            self._sample_random(processed, params, generators, random_rows, tokens, xp)

        # All-greedy on untouched logits (the common case): the argmax already located the max (and the
        # backend's argmax_rows summed the log-normaliser on the way, where it has one).
        if lse is None:
            row_max = logits[xp.arange(num_rows), tokens] if not random_rows and processed is logits else None
            if self.logsumexp_rows is not None:
                lse = self.logsumexp_rows(logits, row_max)
            else:
                lse = _logsumexp_rows(logits, xp, row_max)
        chosen = logits[xp.arange(num_rows), tokens] - lse
        groups = self._top_logprob_arrays(logits, lse, params, xp)
        # One transfer for everything the host needs (on a device: the step's only sync).
        host = sampling_device.fetch([tokens, chosen] + [a for _, ids, lp in groups for a in (ids, lp)], xp)
        top: list[list[tuple[int, float]] | None] = [None] * num_rows
        for b, p in enumerate(params):
            if p.logprobs == 0:
                top[b] = []
        for g, (rows, _, _) in enumerate(groups):
            ids_h, lp_h = host[2 + 2 * g], host[3 + 2 * g]
            for i, b in enumerate(rows):
                top[b] = [(int(t), float(v)) for t, v in zip(ids_h[i], lp_h[i].astype(np.float32))]
        return SamplerOutput(
            token_ids=host[0].astype(np.int64),
            logprobs=host[1].astype(np.float32),
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
        if sampling_device.sample_random_rows(processed, params, random_rows, u, tokens, xp):
            return  # CuPy arrays: every random row in one launch of the sort-free CUDA sampler

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
            temp = xp.asarray(np.array([min(params[b].temperature, MAX_TEMPERATURE) for b in rows], np.float32))
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
            elif xp is not np:  # a device: one bisection over whole rows, no host-side staging
                keep, w = sampling_device.nucleus_mask(scaled, top_p, xp)
                w = w * keep
                if any_min_p:
                    w = w * (w >= min_p[:, None])
                tokens[rows_x] = _inverse_cdf(w, group_u, xp)
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
            covered = to_host(w.sum(axis=1) >= top_p[t] * total[t])
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
    def _top_logprob_arrays(
        logits: Any, lse: Any, params: Sequence[SamplingParams], xp: Any
    ) -> list[tuple[list[int], Any, Any]]:
        """Per distinct `logprobs` n > 0: (rows, token ids [r, n], raw logprobs [r, n]) on xp."""
        by_n: dict[int, list[int]] = defaultdict(list)
        for b, p in enumerate(params):
            if p.logprobs:
                by_n[p.logprobs].append(b)
        out = []
        for n, rows in by_n.items():
            if len(rows) == len(params):
                sub, sub_lse = logits, lse
            else:
                rows_x = xp.asarray(np.asarray(rows, dtype=np.int64))
                sub, sub_lse = logits[rows_x], lse[rows_x]
            ids, vals = _top_candidates(sub, n, xp)
            out.append((rows, ids, vals - sub_lse[:, None]))
        return out
