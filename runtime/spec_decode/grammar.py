"""Speculative decoding of guided sequences: drafts the grammar takes, and nothing else.

Three places, as in vLLM v1's structured outputs with speculation:

    proposal       n-gram drafts are cut before the first token the matcher would refuse
                   (`guided_ngram_drafts`: llguidance validates tentatively, the state is unchanged);
                   a draft model draws every draft under the grammar's mask (`DraftGuide`: mask, draw,
                   advance tentatively, next mask, ..., roll back)
    verification   each of the 1 + k rows gets the mask of the state after the drafts before it
                   (StructuredOutputManager.start_bitmask), applied before rejection sampling, so the
                   target's p at every position is exactly the guided distribution
    afterwards     the matcher advances by the emitted tokens only (the accepted drafts, then the
                   recovered or bonus token); the request stops with "stop" at the token that completes
                   the grammar, even inside a run of accepted drafts

Why a draft model masks instead of cutting: n-gram drafts are a fixed function of the context (a
one-hot q), so dropping some keeps verification exact. A sampled draft is not: cutting the proposal
where the draw landed on a refused token and sampling that position from p instead of from the
residual norm(max(0, p - q)) moves probability (p = (.5, .5, 0), q = (0, .5, .5) gives (.25, .75, 0)).
Drawing from the masked q keeps q the distribution the drafts came from, and proposes only tokens the
target could take. A draft that completes the grammar is the sequence's last: only end-of-sequence
could follow, and the engine stops at the completing token anyway.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .ngram_proposer import propose_ngram
from ..sample.sampling_ops import apply_token_bitmask


def guided_ngram_drafts(structured: Any, request: Any, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Prompt-lookup drafts for `request`, cut before the first one its grammar refuses (if guided)."""
    drafts = propose_ngram(np.asarray(request.all_token_ids), k, lookup_min, lookup_max).tolist()
    return cut_to_grammar(structured, request, drafts)


def cut_to_grammar(structured: Any, request: Any, drafts: list[int]) -> list[int]:
    """Looked-up (one-hot) drafts cut before the first one `request`'s grammar refuses (if guided)."""
    if drafts and structured is not None and request.group is not None and request.group.grammar is not None:
        drafts = drafts[: structured.num_valid_drafts(request, drafts)]
    return drafts


class DraftGuide:
    """The grammar's side of one draft-model proposal over `requests` (index i = requests[i]).

    Each guided sequence's matcher is advanced tentatively by its drafts as they are drawn, and
    `rollback` undoes every advance: after a proposal the matchers are as they were.
    """

    def __init__(self, structured: Any, requests: Sequence[Any]) -> None:
        self.structured = structured
        self._matchers = {i: structured.matcher(r) for i, r in enumerate(requests)
                          if r.group is not None and r.group.grammar is not None}
        self._advanced = dict.fromkeys(self._matchers, 0)

    @property
    def active(self) -> bool:
        return bool(self._matchers)

    def mask(self, logits: Any, indices: Sequence[int], xp: Any) -> Any:
        """`logits` [len(indices), V] (row b belongs to requests[indices[b]]) with the tokens each guided
        sequence's grammar refuses, in its tentative state, at -inf (a new array if any is guided)."""
        rows = [b for b, i in enumerate(indices) if i in self._matchers]
        if not rows:
            return logits
        bits = self.structured.fill_now([self._matchers[indices[b]] for b in rows])
        return apply_token_bitmask(logits, np.asarray(rows, np.int64), bits, xp)

    def advance(self, i: int, token_id: int) -> bool:
        """Take requests[i]'s new draft; False when its grammar is now complete (draft no further)."""
        m = self._matchers.get(i)
        if m is None:
            return True
        if not m.consume_token(token_id):
            # The draw was masked, so this is a bug, not bad input.
            raise RuntimeError(f"draft token {token_id} refused by the grammar: {m.get_error()[:200]}")
        self._advanced[i] += 1
        return not m.is_stopped()

    def rollback(self) -> None:
        for i, m in self._matchers.items():
            if self._advanced[i]:
                m.rollback(self._advanced[i])
            self._advanced[i] = 0
