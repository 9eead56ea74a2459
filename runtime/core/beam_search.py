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

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..structured_outputs_params import StructuredOutputsParams
from .request import Request, RequestStatus

if TYPE_CHECKING:
    from .scheduler import Scheduler
    from .sequence_group import SequenceGroup


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


def advance_beams(group: SequenceGroup, scheduler: Scheduler, new_seq: Callable[[SequenceGroup, str, int], Request],
                  accept: Callable[[Request, int], bool | None], fork_grammar: Callable[[Request, Request], None],
                  max_model_len: int) -> int:
    """Once every live beam of `group` has its proposals (group.beam_pending), pick the new beams (steps 2-4):
    a surviving proposal on a beam already taken forks it (sharing its blocks), a beam no proposal took is
    freed, a beam whose grammar is complete (`accept` true) finishes its hypothesis. Returns the tokens
    appended (0 while a preempted sibling is still being recomputed)."""
    live = group.live
    if any(b.request_id not in group.beam_pending for b in live):
        return 0
    bp = group.beam
    proposals = []
    for k, beam in enumerate(live):
        ids, lps = group.beam_pending.pop(beam.request_id)
        proposals += [Proposal(k, int(t), float(lp), beam.cumulative_logprob + float(lp)) for t, lp in zip(ids, lps)]
    survivors, finished = select(proposals, bp.beam_width, group.eos_token_ids, bp.ignore_eos)
    for p in finished:
        group.beam_done.append((live[p.beam].output_token_ids + [p.token_id], p.score, "stop"))
    taken: set[int] = set()
    new_live: list[Request] = []
    for p in survivors:  # forks first, from each parent's state before any token is appended
        parent = live[p.beam]
        if p.beam in taken:
            child = new_seq(group, group.next_seq_id(), parent.sample_index)
            child.output_token_ids = list(parent.output_token_ids)
            child.all_token_ids = list(parent.all_token_ids)
            child.cumulative_logprob = parent.cumulative_logprob
            child.timings = dataclasses.replace(parent.timings)
            fork_grammar(parent, child)
            if parent.status == RequestStatus.RUNNING:
                scheduler.fork(parent, child)
            else:  # the parent was preempted after proposing: the child recomputes too
                scheduler.add_request(child)
            new_live.append(child)
        else:
            taken.add(p.beam)
            new_live.append(parent)
    for k, beam in enumerate(live):
        if k not in taken:  # a beam that died: its blocks go back (shared ones stay with the others)
            scheduler.finish_request(beam, RequestStatus.FINISHED_ABORTED)
    for beam, p in zip(new_live, survivors):
        beam.append_output_token(p.token_id)
        beam.cumulative_logprob = p.score
        if accept(beam, p.token_id):  # its grammar is complete: a finished hypothesis
            group.beam_done.append((list(beam.output_token_ids), beam.cumulative_logprob, "stop"))
            scheduler.finish_request(beam, RequestStatus.FINISHED_STOPPED)
    new_live = [b for b in new_live if not b.is_finished]
    group.seqs = new_live
    if new_live and (new_live[0].num_output_tokens >= bp.max_tokens or new_live[0].num_tokens >= max_model_len):
        for beam in new_live:
            group.beam_done.append((list(beam.output_token_ids), beam.cumulative_logprob, "length"))
            scheduler.finish_request(beam, RequestStatus.FINISHED_LENGTH)
    return len(survivors)
