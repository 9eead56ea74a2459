"""SpecDecoder: who proposes drafts for the next step, how many, and what came of them.

After each step, every running sequence that is decoding (all but its newest token computed) may get
up to k draft tokens in `request.spec_token_ids`; the scheduler then books it as a (1 + k)-token
query, the model runner verifies the drafts (rejection_sampler.py) and the engine rolls back what was
rejected. k is cut so a verify step can never run past max_tokens or max_model_len.

Whether a sequence speculates on a step, and with how many drafts, is runtime/spec_decode/policy.py's
decision: drafts are verified only when the tokens they are expected to add (acceptance learned per
sequence and per engine, n-gram proposals also checked unverified against what the sequence then
generates) exceed what the extra rows cost (step times measured by row count); k adapts to how much
gets accepted. `min_acceptance_rate` replaces that by a fixed threshold (0: always speculate).

Guided sequences (structured outputs) speculate too: their drafts are ones the grammar takes and each
verify row is masked by the grammar's state after the drafts before it (spec_grammar.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import structlog

from pagedserve.models import registry

from .draft_proposer import DraftProposer, load_draft
from ..core.request import Request, RequestStatus
from .calibration import engine_key, seed_policy, verify_forward
from .config import SpeculativeConfig
from .grammar import DraftGuide, cut_to_grammar, guided_ngram_drafts
from .policy import Candidate, SpecPolicy
from .suffix_proposer import SuffixProposer

if TYPE_CHECKING:
    from ..structured_output.manager import StructuredOutputManager

log = structlog.get_logger("pagedserve.engine")


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


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: DraftProposer | None = None,
                 gpu: bool = False, structured: StructuredOutputManager | None = None) -> None:
        if (config.method == "draft") != (draft is not None):
            raise ValueError("a draft proposer is needed for method 'draft' and only then")
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft
        self.stats = SpecDecodeStats(config.method)
        # The clock of step costs: on a CPU this process's CPU time (other processes on shared cores
        # inflate wall time at random, not the ratio of a verify step to a decode step); on a GPU wall time.
        self.clock = time.perf_counter if gpu else time.process_time
        self.gpu = gpu
        self.policy = SpecPolicy(config.num_speculative_tokens, config.max_num_speculative_tokens,
                                 config.probe_interval, config.min_acceptance_rate, gpu, shadow=draft is None)
        self.structured = structured  # the engine's: guided sequences' drafts are ones their grammar takes
        self.suffix = SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                                     config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob) \
            if config.method == "suffix" else None

    def calibrate(self, executor: Any, block_size: int, num_blocks: int) -> str | None:
        """Seed the policy's step costs with this host's (calibration.py): "cached", "measured", or None where
        skipped (a GPU, tensor parallelism, KV cache groups, a fixed min_acceptance_rate, a pool too small)."""
        worker = executor.driver_worker
        if (self.gpu or self.config.min_acceptance_rate is not None or executor.world_size > 1
                or len(worker.kv_groups.windows) > 1):
            return None
        forward = verify_forward(executor, block_size, num_blocks)
        if forward is None:
            return None
        source = seed_policy(self.policy, engine_key(worker), forward, self.clock)
        costs = self.policy.costs
        log.info("engine.spec_step_costs", source=source, ms_1_row=round(1e3 * costs.estimate(1), 3),
                 verify_5_rows_in_steps=round(costs.ratio(5, 1), 3), verify_9_rows_in_steps=round(costs.ratio(9, 1), 3))
        return source

    def free(self, seq_id: str) -> None:
        """The sequence left the running set (finished, aborted, preempted): drop its draft cache (a draft
        model's KV, a suffix method's local tree; its output stays in the global suffix tree)."""
        if self.draft is not None:
            self.draft.free(seq_id)
        if self.suffix is not None:
            self.suffix.free(seq_id)

    def num_lookahead(self, r: Request, k: int | None = None) -> int:
        """Most drafts worth proposing: a verify step emits up to k + 1 tokens and writes k + 1 slots."""
        p = r.sampling_params
        k = self.config.num_speculative_tokens if k is None else k
        return max(0, min(k, p.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1))

    def propose(self, running: Sequence[Request]) -> None:
        """Set spec_token_ids (and spec_draft_probs) for the next step of every sequence that should speculate."""
        policy, c = self.policy, self.config
        candidates: list[Candidate] = []
        lookups: list[list[int]] = []
        num_decoding = 0
        for r in running:
            r.spec_token_ids, r.spec_draft_probs = [], None
            if r.status != RequestStatus.RUNNING or r.num_tokens - r.num_computed_tokens != 1:
                continue
            num_decoding += 1
            if r.group is not None and r.group.beam is not None:
                continue  # beams advance together from their proposals: no speculation
            if r.group is not None and r.group.num_to_fork:
                # The prompt's last token is still to come (chunked prefill left just it): the other samples
                # fork from that step's one logits row, which a verify step would not hand them.
                continue
            record = r.spec_state
            if record is None:
                record = r.spec_state = policy.new_record()
            k = self.num_lookahead(r, record.k)
            if self.draft is None:
                tokens = r.all_token_ids
                policy.catch_up(record, tokens)
                if k <= 0:
                    continue
                if self.suffix is not None:
                    drafts = self.suffix.propose(r.request_id, r, tokens, r.num_prompt_tokens, k)
                    drafts = cut_to_grammar(self.structured, r, drafts)
                else:
                    drafts = guided_ngram_drafts(self.structured, r, k, c.prompt_lookup_min, c.prompt_lookup_max)
                if not drafts:
                    continue  # no match: nothing to verify or to check
                lookups.append(drafts)
                k = len(drafts)
            elif k <= 0:
                continue
            candidates.append(Candidate(r, record, k))
        chosen = policy.choose(candidates, num_decoding)
        picked = {id(x) for x in chosen}
        for n, cand in enumerate(candidates):
            if id(cand) in picked:
                cand.record.shadow = None  # verified instead
                if self.draft is None:
                    cand.key.spec_token_ids = lookups[n]
            else:
                policy.declined(cand.record)
                if self.draft is None:
                    policy.set_shadow(cand.record, lookups[n], cand.key.num_tokens)
        if chosen and self.draft is not None:
            reqs, ks = [x.key for x in chosen], [x.num_drafts for x in chosen]
            guide = DraftGuide(self.structured, reqs) if self.structured is not None else None
            started = self.clock()
            try:
                proposals = self.draft.propose(reqs, ks, guide if guide is not None and guide.active else None)
            finally:
                if guide is not None:
                    guide.rollback()  # the matchers move only with the tokens the target accepts
            for r, (drafts, q) in zip(reqs, proposals):
                r.spec_token_ids, r.spec_draft_probs = drafts, q
            policy.observe_drafting(max(ks), self.clock() - started)

    def observe(self, r: Request, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verify step of `r` and let the policy learn from it."""
        if num_draft_tokens <= 0:
            return
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_draft_tokens
        s.num_accepted_tokens += num_accepted
        if r.spec_state is None:
            r.spec_state = self.policy.new_record()
        self.policy.observe_verify(r.spec_state, num_draft_tokens, num_accepted)

    def observe_step(self, scheduled: Sequence[Any], num_rows: int, seconds: float) -> None:
        """A step's forward and sampling took `seconds` (self.clock); steps of decodes and verifies only."""
        if all(s.num_new_tokens == 1 + len(s.spec_token_ids) for s in scheduled):
            self.policy.observe_step(num_rows, seconds)


def build_spec_decoder(config: SpeculativeConfig | None, target: Callable[[], Any], backend: Any, num_blocks: int,
                       block_size: int, max_model_len: int, seed: int | None, use_cache: bool = True,
                       structured: StructuredOutputManager | None = None, kv_storage: Any = None,
                       executor: Any = None) -> SpecDecoder | None:
    """The engine's SpecDecoder (None when speculation is off); loads or builds the draft model. `kv_storage`: the
    dtype of the draft's KV pool, the target's (KVCacheLayout.storage; None: the backend's).

    target: gives the target's LoadedModel (whole weights), called only for a draft model. The draft runs
    unsharded beside the driver (rank 0), whatever the tensor-parallel size. executor (its KV pool allocated):
    where the policy's step costs are calibrated before the first step (calibration.py); None: not calibrated.
    """
    if config is None:
        return None
    draft = None
    if config.method == "draft":
        cfg, weights, name = load_draft(config.model, config.draft_num_layers, target(), use_cache)
        model = registry.for_config(cfg).model_class(cfg, weights, backend, source=name)
        draft = DraftProposer(model, num_blocks, block_size, seed, kv_storage)
    spec = SpecDecoder(config, max_model_len, draft, gpu=bool(getattr(backend, "is_gpu", False)), structured=structured)
    if executor is not None:
        spec.calibrate(executor, block_size, num_blocks)
    return spec
