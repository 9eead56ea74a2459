"""Beam search, inside the engine: beams are sequences that fork and free KV blocks as they split and die.

The rule, step by step (tests/runtime/test_beam_search.py checks it against a plain brute-force run):

1. every live beam proposes its 2 * beam_width most likely next tokens (raw log-softmax; ties broken
   by the lower token id), scored by cumulative logprob;
2. all proposals are sorted by score (ties: earlier beam, then its rank);
3. walking that order, an end-of-sequence proposal among the first beam_width finishes a hypothesis
   (its eos token included); other eos proposals are dropped; non-eos proposals become the new live
   beams until there are beam_width of them;
4. at max_tokens (or max_model_len) the live beams finish as they are.
With structured outputs each beam proposes only tokens its own grammar matcher allows (a forked beam
copies its parent's matcher), and a beam whose grammar is complete finishes its hypothesis.
The result: the beam_width finished hypotheses with the best cumulative_logprob / length**length_penalty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..structured_outputs_params import StructuredOutputsParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False
    # Guided beams: every beam proposes only tokens its grammar allows; a beam whose grammar is complete
    # is a finished hypothesis.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= 64:
            raise ValueError(f"beam_width must be an int in [1, 64], got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")


@dataclass(frozen=True)
class Proposal:
    beam: int  # index of the live beam it extends
    token_id: int
    logprob: float
    score: float  # cumulative logprob with this token


def select(proposals: list[Proposal], width: int, eos_ids: tuple[int, ...],
           ignore_eos: bool) -> tuple[list[Proposal], list[Proposal]]:
    """Apply steps 2 and 3: returns (new live beams, finished hypotheses)."""
    ranked = sorted(enumerate(proposals), key=lambda ip: (-ip[1].score, ip[1].beam, ip[0]))
    live: list[Proposal] = []
    finished: list[Proposal] = []
    for position, (_, p) in enumerate(ranked):
        if not ignore_eos and p.token_id in eos_ids:
            if position < width:
                finished.append(p)
            continue
        live.append(p)
        if len(live) == width:
            break
    return live, finished


def length_penalized(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    return cumulative_logprob / (max(length, 1) ** length_penalty)
