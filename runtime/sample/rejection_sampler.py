"""Exact rejection sampling of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

A speculating sequence is verified in one target forward: its newest token and k drafts d1..dk give
k + 1 logits rows. Row j is the target's distribution p_j for the position draft d_{j+1} claims
(row k: the position after the last draft). With q_j the distribution d_{j+1} was drawn from::

    for j = 0 .. k-1:   accept d_{j+1} with probability min(1, p_j(d) / q_j(d))
                        on rejection: emit a token drawn from norm(max(0, p_j - q_j)) and stop
    all k accepted:     emit a bonus token drawn from p_k

The emitted tokens are distributed exactly as k + 1 tokens sampled from the target one at a time.
n-gram drafts have a one-hot q (q(d) = 1, so acceptance is p(d), and the residual is p with d
removed); greedy rows accept while the draft equals the argmax, and emit the argmax where they stop.

p_j is the sampler's distribution, computed the same way as without speculation: penalties over the
prompt, the output *and the drafts before row j*, the min_tokens ban counted the same way, a guided
sequence's grammar mask of the state after the drafts before row j, then temperature, top_k, top_p,
min_p (runtime/sample/sampler.py's order and rules). Uniforms come from the
request's own generator when it is seeded, else from the shared one, k + 1 per random sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from pagedserve.cupy_kernels.backend import to_host

from .sampler import Sampler
from .sampling_ops import _inverse_cdf, _logsumexp_rows, apply_penalties_and_bans, apply_token_bitmask
from ..sampling_params import MAX_TEMPERATURE, SamplingParams, SamplingType


@dataclass
class VerifyOutput:
    """One speculating sequence's result: the accepted drafts, then one more token."""

    token_ids: list[int]
    logprobs: list[float]  # raw log-softmax of the target at each emitted token
    top_logprobs: list[list[tuple[int, float]] | None]
    num_accepted: int  # drafts accepted (len(token_ids) - 1)


def dense_probs(processed: Any, params: Sequence[SamplingParams], xp: Any = np) -> Any:
    """Probabilities [R, V] after temperature, top_k, top_p and min_p, for random-sampling rows.

    The same rules as the sampler (top_k keeps the k largest, top_p acts on the distribution
    renormalised over them and keeps the most likely token, min_p keeps p >= min_p * p_max), written
    densely because rejection sampling needs p(x) of every token, not a single draw.
    """
    num_rows, vocab_size = processed.shape
    temp = xp.asarray(np.array([min(p.temperature, MAX_TEMPERATURE) for p in params], np.float32))
    x = processed / temp[:, None]
    x -= x.max(axis=1, keepdims=True)
    w = xp.exp(x)  # the most likely token has weight 1
    by_k: dict[int, list[int]] = {}
    for b, p in enumerate(params):
        if 0 < p.top_k < vocab_size:
            by_k.setdefault(p.top_k, []).append(b)
    for k, rows_k in by_k.items():
        rows = xp.asarray(np.asarray(rows_k, np.int64))
        sub = x[rows]
        kth = -xp.partition(-sub, k - 1, axis=1)[:, k - 1]
        w[rows] *= sub >= kth[:, None]
    top_p_rows = [b for b, p in enumerate(params) if p.top_p < 1.0]
    if top_p_rows:
        rows = xp.asarray(np.asarray(top_p_rows, np.int64))
        sub = w[rows]
        probs = sub / sub.sum(axis=1, keepdims=True)
        desc = -xp.sort(-probs, axis=1)
        before = xp.cumsum(desc, axis=1) - desc
        top_p = xp.asarray(np.array([params[b].top_p for b in top_p_rows], np.float32))
        num_keep = xp.maximum((before < top_p[:, None]).sum(axis=1), 1)
        cutoff = desc[xp.arange(len(top_p_rows)), num_keep - 1]
        w[rows] = sub * (probs >= cutoff[:, None])
    min_p = np.array([p.min_p for p in params], np.float32)
    if (min_p > 0).any():
        w *= w >= xp.asarray(min_p)[:, None]
    return w / w.sum(axis=1, keepdims=True)


class RejectionSampler:
    """Verifies the drafts of several sequences from one batch of target logits rows."""

    def __init__(self, generator: np.random.Generator) -> None:
        self.generator = generator  # shared by unseeded requests (the Sampler's own)

    def __call__(self, logits: Any, requests: Sequence[Any], drafts: Sequence[Sequence[int]],
                 draft_probs: Sequence[Any | None], xp: Any = np, grammar_bitmask: Any = None) -> list[VerifyOutput]:
        """logits: [sum(k_i + 1), V] float32, sequence i's k_i + 1 rows in order; draft_probs[i]: [k_i, V]
        or None (one-hot q); grammar_bitmask: structured_output.GrammarBitmask of the guided rows (numbered
        like the logits rows) or None."""
        counts = [len(d) + 1 for d in drafts]
        if logits.shape[0] != sum(counts):
            raise ValueError(f"logits has {logits.shape[0]} rows, the drafts need {sum(counts)}")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        row_req = [r for r, n in zip(requests, counts) for _ in range(n)]
        row_params = [r.sampling_params for r in row_req]
        row_out = [list(r.output_token_ids) + list(d[:j]) for r, d in zip(requests, drafts) for j in range(len(d) + 1)]
        banned = [r.banned_token_ids(j) for r, d in zip(requests, drafts) for j in range(len(d) + 1)]
        processed = apply_penalties_and_bans(logits, row_params, [r.prompt_token_ids for r in row_req], row_out,
                                             banned if any(banned) else None, xp)
        if grammar_bitmask is not None:
            processed = apply_token_bitmask(processed, grammar_bitmask.rows, grammar_bitmask.bits, xp,
                                            copy=processed is logits)
        greedy = [r.sampling_params.sampling_type == SamplingType.GREEDY for r in requests]
        accepted = [0] * len(requests)
        final = [0] * len(requests)

        greedy_rows = [int(s) + j for i, s in enumerate(starts) if greedy[i] for j in range(counts[i])]
        if greedy_rows:
            argmax = to_host(xp.argmax(processed[xp.asarray(np.asarray(greedy_rows))], axis=1)).tolist()
            at = 0
            for i, d in enumerate(drafts):
                if not greedy[i]:
                    continue
                best = argmax[at : at + counts[i]]
                at += counts[i]
                a = 0
                while a < len(d) and best[a] == d[a]:
                    a += 1
                accepted[i], final[i] = a, int(best[a])

        random_seqs = [i for i in range(len(requests)) if not greedy[i]]
        if random_seqs:
            self._verify_random(processed, row_params, starts, counts, requests, drafts, draft_probs, random_seqs,
                                accepted, final, xp)

        # Report raw logprobs (as the sampler does) of the emitted tokens, and top logprobs if asked.
        emitted = [list(d[: accepted[i]]) + [final[i]] for i, d in enumerate(drafts)]
        rows = np.concatenate([starts[i] + np.arange(len(e)) for i, e in enumerate(emitted)]).astype(np.int64)
        toks = np.concatenate([np.asarray(e, np.int64) for e in emitted])
        sub = logits[xp.asarray(rows)]
        lse = _logsumexp_rows(sub, xp)
        chosen = to_host(sub[xp.arange(len(rows)), xp.asarray(toks)] - lse).tolist()
        top = _top_logprobs(sub, lse, [row_params[int(r)] for r in rows], xp)
        out, at = [], 0
        for i, e in enumerate(emitted):
            out.append(VerifyOutput(e, chosen[at : at + len(e)], top[at : at + len(e)], accepted[i]))
            at += len(e)
        return out

    def _verify_random(self, processed: Any, row_params: list[SamplingParams], starts: np.ndarray,
                       counts: list[int], requests: Sequence[Any], drafts: Sequence[Sequence[int]],
                       draft_probs: Sequence[Any | None], seqs: list[int], accepted: list[int], final: list[int],
                       xp: Any) -> None:
        """The random-sampling sequences, vectorised across them: one gather of p(d) and q(d), one
        acceptance test, one draw from the stacked residual (or bonus) rows."""
        ks = np.array([counts[i] - 1 for i in seqs], np.int64)
        rows = np.concatenate([starts[i] + np.arange(counts[i]) for i in seqs]).astype(np.int64)
        probs = dense_probs(processed[xp.asarray(rows)], [row_params[int(r)] for r in rows], xp)
        local = np.concatenate([[0], np.cumsum(ks + 1)[:-1]]).astype(np.int64)  # each sequence's first row
        seg = np.repeat(np.arange(len(seqs)), ks)  # draft index -> sequence
        first_draft = np.concatenate([[0], np.cumsum(ks)[:-1]]).astype(np.int64)
        j = np.arange(int(ks.sum())) - first_draft[seg]  # draft's position within its sequence
        draft_toks = np.concatenate([np.asarray(drafts[i], np.int64) for i in seqs])
        p_draft = to_host(probs[xp.asarray(local[seg] + j), xp.asarray(draft_toks)]).astype(np.float64)
        # q(d): 1 for one-hot (n-gram) drafts; else gathered from the stacked draft distributions.
        q_draft = np.ones_like(p_draft)
        with_q = [n for n, i in enumerate(seqs) if draft_probs[i] is not None]
        q_rows = None
        if with_q:
            q_rows = xp.concatenate([draft_probs[seqs[n]][: ks[n]] for n in with_q])
            at = np.concatenate([first_draft[n] + np.arange(ks[n]) for n in with_q]).astype(np.int64)
            q_draft[at] = to_host(q_rows[xp.arange(len(at)), xp.asarray(draft_toks[at])]).astype(np.float64)
            q_index = np.full(int(ks.sum()), -1, np.int64)  # draft index -> row of q_rows
            q_index[at] = np.arange(len(at))
        # k + 1 uniforms per sequence: its own generator when seeded, else the shared one in order.
        u = np.empty(int((ks + 1).sum()))
        u_start = np.concatenate([[0], np.cumsum(ks + 1)[:-1]]).astype(np.int64)
        shared = [n for n, i in enumerate(seqs) if requests[i].generator is None]
        if shared:
            idx = np.concatenate([u_start[n] + np.arange(ks[n] + 1) for n in shared])
            u[idx] = self.generator.random(len(idx))
        for n, i in enumerate(seqs):
            if requests[i].generator is not None:
                u[u_start[n] : u_start[n] + ks[n] + 1] = requests[i].generator.random(ks[n] + 1)
        # Accept d with probability min(1, p(d) / q(d)): u * q(d) < p(d), no division by a small q.
        ok = u[u_start[seg] + j] * q_draft < p_draft
        first_reject = np.where(ok, ks[seg], j)
        a = np.minimum.reduceat(first_reject, first_draft) if len(seqs) else first_reject
        final_rows = probs[xp.asarray(local + a)]  # a fresh array (fancy indexing)
        rejected = np.flatnonzero(a < ks)
        if rejected.size:
            drop = first_draft[rejected] + a[rejected]  # the rejected draft of each such sequence
            one_hot = [(n, d) for n, d in zip(rejected, drop) if q_rows is None or q_index[d] < 0]
            if one_hot:  # q one-hot: norm(max(0, p - q)) is p without the draft token
                nn = np.array([n for n, _ in one_hot])
                final_rows[xp.asarray(nn), xp.asarray(draft_toks[[d for _, d in one_hot]])] = 0
            dense = [(n, d) for n, d in zip(rejected, drop) if q_rows is not None and q_index[d] >= 0]
            if dense:
                nn = xp.asarray(np.array([n for n, _ in dense]))
                qq = q_rows[xp.asarray(q_index[[d for _, d in dense]])]
                final_rows[nn] = xp.maximum(final_rows[nn] - qq, 0)
            # p == q up to rounding leaves nothing: rejection had probability 0 there, so draw from p.
            empty = np.flatnonzero(to_host(final_rows.sum(axis=1)) <= 0)
            if empty.size:
                final_rows[xp.asarray(empty)] = probs[xp.asarray(local[empty] + a[empty])]
        picks = to_host(_inverse_cdf(final_rows, xp.asarray(u[u_start + ks]), xp)).tolist()
        for n, i in enumerate(seqs):
            accepted[i], final[i] = int(a[n]), int(picks[n])


def _top_logprobs(logits: Any, lse: Any, params: Sequence[SamplingParams],
                  xp: Any) -> list[list[tuple[int, float]] | None]:
    """Per row: the `logprobs` most likely raw tokens as (id, logprob), [] for logprobs=0, None if not asked
    (the sampler's rule, from its own arrays)."""
    top: list[list[tuple[int, float]] | None] = [[] if p.logprobs == 0 else None for p in params]
    for rows, ids, lps in Sampler._top_logprob_arrays(logits, lse, params, xp):
        ids_h, lp_h = to_host(ids), to_host(lps).astype(np.float32)
        for i, b in enumerate(rows):
            top[b] = [(int(t), float(v)) for t, v in zip(ids_h[i], lp_h[i])]
    return top
