"""SequenceGroup: one user request and the sequences that serve it.

    n = 1                 one sequence
    n > 1 at temperature 0   one greedy sequence; its output is copied to choices 0..n-1 (group_output), so
                          n identical choices cost one sequence's KV and compute, never n greedy runs
    n > 1 (best_of)       sequence 0 prefills the prompt; when its prefill completes, the other samples
                          fork from it (sharing every prompt block by ref count) and each samples its
                          own first token from the same logits; a shared partial last block is copied
                          on a sample's first write (copy-on-write)
    beam search           the live beams; they fork and are freed as beams split and die

The group's id is the user's request id; sequence ids are `<id>` for sequence 0 and `<id>#<k>` after.
"""

from __future__ import annotations

import copy
import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .beam_search import BeamSearchParams, length_penalized
from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from .request import Request
from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from .scheduler import Scheduler


def sample_generator(seed: int | None, index: int) -> np.random.Generator | None:
    """Sample 0 uses the seed itself (so it equals the same request with n=1); others derive from it."""
    if seed is None:
        return None
    return np.random.default_rng(seed if index == 0 else [seed, index])


@dataclass(eq=False)
class SequenceGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Request] = field(default_factory=list)  # sample order; for beams: the live beams
    num_to_fork: int = 0  # samples still to fork from seqs[0] once its prefill completes
    beam: BeamSearchParams | None = None
    # Finished hypotheses: (token ids, cum logprob, finish reason). "stop": it ended (end-of-sequence, or its
    # grammar is complete, even on the last allowed token); "length": cut at max_tokens or max_model_len.
    beam_done: list[tuple[list[int], float, str]] = field(default_factory=list)
    beam_pending: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    num_created: int = 1
    first: Request | None = None  # sequence 0: its timings are the request's timings
    aborted: bool = False
    eos_token_ids: tuple[int, ...] = ()
    grammar: Future | None = None  # structured outputs: the compiled template matcher (grammar_compiler.py)
    lora_request: Any = None  # runtime.lora.LoRARequest: every sequence of the group runs with this adapter

    @property
    def n(self) -> int:
        return self.beam.beam_width if self.beam else self.params.n

    @property
    def copies(self) -> int:
        """How many choices each sequence's output fills: n for greedy n > 1 (one run, copied), else 1."""
        return self.params.n if self.beam is None and self.params.is_greedy else 1

    def fan_out(self, completions: list[CompletionOutput]) -> list[CompletionOutput]:
        """Greedy n > 1: the one sequence's outputs as choices 0..n-1, each its own copy."""
        if self.copies == 1:
            return completions
        return [dataclasses.replace(copy.deepcopy(c), index=i) for c in completions for i in range(self.copies)]

    def next_seq_id(self) -> str:
        self.num_created += 1
        return f"{self.request_id}#{self.num_created - 1}"

    @property
    def live(self) -> list[Request]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        return self.aborted or (not self.live and self.num_to_fork == 0)

    def fork_samples(self, parent: Request, children: list[Request], scheduler: Scheduler) -> None:
        """Samples 1.. of an n > 1 request, once sequence 0's prefill completes: each shares every block of
        the prompt (copy-on-write) and runs from the next step; nothing is left to fork."""
        for child in children:
            child.num_cached_tokens = parent.num_cached_tokens
            child.timings = dataclasses.replace(parent.timings)
            scheduler.fork(parent, child)
            self.seqs.append(child)
        self.num_to_fork = 0

    def final_completions(self, decode) -> list[CompletionOutput]:
        """The outputs the user gets once the group is done (best n by cumulative logprob for best_of)."""
        if self.beam is not None:
            ranked = sorted(self.beam_done, key=lambda h: -length_penalized(h[1], len(h[0]), self.beam.length_penalty))
            return [CompletionOutput(index=i, text=decode(ids), token_ids=ids, cumulative_logprob=cum, logprobs=None,
                                     finish_reason=reason)
                    for i, (ids, cum, reason) in enumerate(ranked[: self.beam.beam_width])]
        samples = sorted(self.seqs, key=lambda s: s.sample_index)
        if len(samples) > self.params.n:  # best_of > n: keep the n most likely
            samples = sorted(samples, key=lambda s: -s.cumulative_logprob)[: self.params.n]
        return [completion(s, index=i) for i, s in enumerate(samples)]


def completion(r: Request, index: int, new_text: str = "", new_ids: list[int] | None = None) -> CompletionOutput:
    logprobs = None
    if r.sampling_params.logprobs is not None:
        logprobs = [{r.output_token_ids[i]: lp, **dict(top)} for i, (lp, top)
                    in enumerate(zip(r.output_logprobs, r.output_top_logprobs))]
    return CompletionOutput(index=index, text=r.detokenizer.output_text if r.detokenizer else "",
                            token_ids=list(r.output_token_ids), cumulative_logprob=r.cumulative_logprob,
                            logprobs=logprobs, finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                            new_text=new_text, new_token_ids=new_ids or [])


def group_output(group: SequenceGroup, completions: list[CompletionOutput], finished: bool) -> RequestOutput:
    """The request's output: its sequences' completions, fanned out to the n choices (SequenceGroup.fan_out)."""
    completions = group.fan_out(completions)
    first = group.first
    t = first.timings if first is not None else None
    metrics = RequestMetrics(group.arrival_time, t.first_scheduled if t else None, t.first_token if t else None,
                             t.finished if t else None)
    return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished, metrics,
                         first.num_cached_tokens if first is not None else 0)
