"""SpecDecoder: who proposes drafts for the next step, how many, and what came of them.

After each step, every running sequence that is decoding (all but its newest token computed) may get
up to k draft tokens in `request.spec_token_ids`; the scheduler then books it as a (1 + k)-token
query, the model runner verifies the drafts (rejection_sampler.py) and the engine rolls back what was
rejected. k is cut so a verify step can never run past max_tokens or max_model_len.

Switching off where it loses. A draft costs target compute whether or not it is accepted, so each
sequence keeps an exponential moving average of its acceptance rate (accepted / proposed per verify
step, starting at 1.0, weight 1/2 on the newest); below `min_acceptance_rate` (0.3 by default: two verify
steps that accept nothing) it stops proposing and tries again once every `probe_interval` steps (16), so a
sequence where drafts never pay spends at most about one step in 16 on them. An n-gram proposer that finds
no match proposes nothing and costs nothing.

Guided sequences (structured outputs) speculate too: their drafts are ones the grammar takes and each
verify row is masked by the grammar's state after the drafts before it (spec_grammar.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pagedserve.models.llama import LlamaForCausalLM

from .draft_proposer import DraftProposer, load_draft
from .request import Request, RequestStatus
from .spec_config import SpeculativeConfig
from .spec_grammar import DraftGuide, guided_ngram_drafts

_EMA_WEIGHT = 0.5


@dataclass
class SpecDecodeStats:
    method: str
    num_drafts: int = 0  # verify steps: (sequence, step) pairs that carried drafts
    num_draft_tokens: int = 0  # drafts proposed and verified
    num_accepted_tokens: int = 0  # drafts the target accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: the accepted drafts plus the one the target always adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _SeqRecord:
    acceptance: float = 1.0  # moving average of accepted / proposed (optimistic start)
    steps_off: int = 0


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: DraftProposer | None = None) -> None:
        if (config.method == "draft") != (draft is not None):
            raise ValueError("a draft proposer is needed for method 'draft' and only then")
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft
        self.stats = SpecDecodeStats(config.method)
        self.structured: Any = None  # the engine's StructuredOutputManager: guided sequences' grammars

    def free(self, seq_id: str) -> None:
        """The sequence left the running set (finished, aborted, preempted): drop its draft cache."""
        if self.draft is not None:
            self.draft.free(seq_id)

    def num_lookahead(self, r: Request) -> int:
        """Most drafts worth proposing: a verify step emits up to k + 1 tokens and writes k + 1 slots."""
        p = r.sampling_params
        return max(0, min(self.config.num_speculative_tokens, p.max_tokens - r.num_output_tokens - 1,
                          self.max_model_len - r.num_tokens - 1))

    def propose(self, running: Sequence[Request]) -> None:
        """Set spec_token_ids (and spec_draft_probs) for the next step of every sequence that should speculate."""
        chosen: list[Request] = []
        ks: list[int] = []
        for r in running:
            r.spec_token_ids, r.spec_draft_probs = [], None
            if r.status != RequestStatus.RUNNING or r.num_tokens - r.num_computed_tokens != 1:
                continue
            if r.group is not None and r.group.beam is not None:
                continue  # beams advance together from their proposals: no speculation
            if r.group is not None and r.group.num_to_fork:
                # The prompt's last token is still to come (chunked prefill left just it): the other samples
                # fork from that step's one logits row, which a verify step would not hand them.
                continue
            k = self.num_lookahead(r)
            if k <= 0 or not self._wants_to_speculate(r):
                continue
            chosen.append(r)
            ks.append(k)
        if not chosen:
            return
        if self.draft is not None:
            guide = DraftGuide(self.structured, chosen) if self.structured is not None else None
            try:
                proposals = self.draft.propose(chosen, ks, guide if guide is not None and guide.active else None)
            finally:
                if guide is not None:
                    guide.rollback()  # the matchers move only with the tokens the target accepts
            for r, (drafts, q) in zip(chosen, proposals):
                r.spec_token_ids, r.spec_draft_probs = drafts, q
            return
        c = self.config
        for r, k in zip(chosen, ks):
            r.spec_token_ids = guided_ngram_drafts(self.structured, r, k, c.prompt_lookup_min, c.prompt_lookup_max)

    def _wants_to_speculate(self, r: Request) -> bool:
        record = r.spec_state
        if record is None:
            record = r.spec_state = _SeqRecord()
        if record.acceptance >= self.config.min_acceptance_rate:
            return True
        record.steps_off += 1
        return record.steps_off % self.config.probe_interval == 0

    def observe(self, r: Request, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verify step of `r` and update its moving acceptance rate."""
        if num_draft_tokens <= 0:
            return
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_draft_tokens
        s.num_accepted_tokens += num_accepted
        record = r.spec_state if r.spec_state is not None else _SeqRecord()
        record.acceptance += _EMA_WEIGHT * (num_accepted / num_draft_tokens - record.acceptance)
        r.spec_state = record


def build_spec_decoder(config: SpeculativeConfig | None, target: Callable[[], Any], backend: Any, num_blocks: int,
                       block_size: int, max_model_len: int, seed: int | None, use_cache: bool = True) -> SpecDecoder | None:
    """The engine's SpecDecoder (None when speculation is off); loads or builds the draft model.

    target: gives the target's LoadedModel (whole weights), called only for a draft model. The draft runs
    unsharded beside the driver (rank 0), whatever the tensor-parallel size.
    """
    if config is None:
        return None
    draft = None
    if config.method == "draft":
        cfg, weights, name = load_draft(config.model, config.draft_num_layers, target(), use_cache)
        draft = DraftProposer(LlamaForCausalLM(cfg, weights, backend, source=name), num_blocks, block_size, seed)
    return SpecDecoder(config, max_model_len, draft)
