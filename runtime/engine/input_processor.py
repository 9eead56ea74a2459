"""Before a request is queued: its limits checked, its prompt tokenized, its sequences built.

Nothing here touches engine state, so the async engine validates requests on its own thread: a request the
server would refuse allocates nothing (request_limits.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

from ..core.beam_search import BeamSearchParams
from ..core.request import Request
from ..core.sequence_group import SequenceGroup, sample_generator
from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .request_limits import RequestLimits, ServerShape, check_fits, check_ids, check_params, check_prompt_ids

if TYPE_CHECKING:
    from ..structured_output.manager import StructuredOutputManager


class InputProcessor:
    def __init__(self, tokenizer, limits: RequestLimits, shape: ServerShape, structured: StructuredOutputManager,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.shape = shape
        self.structured = structured
        self.eos_token_ids = eos_token_ids

    def make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     arrival_time: float | None = None, cache_salt: str | None = None,
                     tenant: str | None = None, priority: int = 0, lora_request=None) -> SequenceGroup:
        """Validate a request and build it (sequence 0; its other samples fork when its prefill completes)."""
        params = params or SamplingParams()
        # Limits first, tokenizing after: nothing is allocated for a request the server would refuse.
        check_ids(self.limits, request_id, cache_salt)
        if isinstance(priority, bool) or not isinstance(priority, int) or not -2**31 <= priority < 2**31:
            raise ValueError(f"priority must be a 32-bit integer, got {str(priority)[:40]!r}")
        check_params(self.limits, self.shape, params)
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, check_prompt_ids(self.shape, prompt)
        check_fits(self.shape, len(ids), params)
        arrival = arrival_time or time.monotonic()
        group = SequenceGroup(request_id, text, ids, params, arrival, eos_token_ids=self.eos_token_ids,
                              num_to_fork=params.num_sequences - 1)
        group.lora_request = lora_request
        if params.structured_outputs is not None:
            group.grammar = self.structured.compile(params.structured_outputs)
        first = self.new_seq(group, request_id, 0)
        first.cache_salt, first.tenant, first.priority = cache_salt, tenant, priority
        group.seqs.append(first)
        group.first = first
        return group

    def make_beam_request(self, request_id: str, prompt: str | Sequence[int], params: BeamSearchParams,
                          arrival_time: float | None = None, lora_request=None) -> SequenceGroup:
        """A beam search; refused when its beams could outgrow the KV pool or the sequence slots."""
        sampling = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True,
                                  structured_outputs=params.structured_outputs)
        group = self.make_request(request_id, prompt, sampling, arrival_time, lora_request=lora_request)
        group.beam = params
        shape = self.shape
        per_beam = -(-(len(group.prompt_token_ids) + params.max_tokens) // shape.block_size)
        if params.beam_width * per_beam > shape.num_kv_blocks or params.beam_width > shape.max_num_seqs:
            raise ValueError(f"beam search of width {params.beam_width} needs up to {params.beam_width * per_beam} "
                             f"KV blocks and {params.beam_width} sequence slots; the pool has {shape.num_kv_blocks} "
                             f"blocks and max_num_seqs is {shape.max_num_seqs}")
        return group

    def new_seq(self, group: SequenceGroup, seq_id: str, index: int) -> Request:
        """Sequence `index` of `group` (its sample index: its seed and place among the outputs)."""
        p = group.params
        r = Request(seq_id, group.prompt_token_ids, p, group.arrival_time, eos_token_ids=group.eos_token_ids,
                    prompt=group.prompt, generator=sample_generator(p.seed, index), sample_index=index, group=group,
                    lora_request=group.lora_request)
        if group.first is not None:  # a fork: the same owner, priority and cache salt as sequence 0
            r.cache_salt, r.tenant, r.priority = group.first.cache_salt, group.first.tenant, group.first.priority
        r.detokenizer = IncrementalDetokenizer(
            self.tokenizer, group.prompt_token_ids, skip_special_tokens=p.skip_special_tokens, stop=p.stop,
            include_stop_str_in_output=p.include_stop_str_in_output, min_tokens=p.min_tokens)
        return r
