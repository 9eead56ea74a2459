"""After a step: each scheduled sequence's samples appended, its stop conditions checked, its text detokenized,
and one RequestOutput for every request that moved.

The KV side of the same update (computed tokens, cached blocks, forks, rejected drafts, finishing) goes
through the scheduler; nothing here touches the KV cache manager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..core.beam_search import advance_beams
from ..core.request import Request, RequestStatus
from ..core.scheduler import ScheduledRequest, Scheduler
from ..core.sequence_group import SequenceGroup, completion, group_output
from ..outputs import CompletionOutput, RequestOutput
from ..structured_output.schema_check import violations
from .model_runner import SampledToken, StepResult
from .request_events import RequestEvents

if TYPE_CHECKING:
    from ..sampling_params import SamplingParams
    from ..spec_decode.decoder import SpecDecoder
    from ..structured_output.manager import StructuredOutputManager


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, structured: StructuredOutputManager, events: RequestEvents,
                 decode: Callable[[list[int]], str], max_model_len: int,
                 new_seq: Callable[[SequenceGroup, str, int], Request], spec: SpecDecoder | None,
                 export: Callable[[Request], None]) -> None:
        self.scheduler = scheduler
        self.structured = structured
        self.events = events
        self.decode = decode
        self.max_model_len = max_model_len
        self.new_seq = new_seq  # a sequence of the group (a beam forking)
        self.spec = spec
        self.export = export  # a prefill instance's finished prompt blocks, handed to the KV connector

    def update(self, s: ScheduledRequest, result: StepResult | None, children: list[Request],
               now: float) -> tuple[list[CompletionOutput] | None, int]:
        """One scheduled sequence after the forward (`children`: the samples forking from it now). Returns its
        group's new completions (None: nothing to report) and the number of tokens appended."""
        r = s.request
        self.scheduler.commit_computed(r, s.num_real_tokens)  # drafts count once accepted
        if r.kv_export is not None and r.num_computed_tokens >= r.num_prompt_tokens:
            self.export(r)  # before it finishes
        if result is None:
            return None, 0  # a prefill chunk that did not reach the end of the prompt
        group = r.group
        if r.timings.first_token is None:
            r.timings.first_token = now
            self.events.first_token(r, now)
        if group.beam is not None:
            group.beam_pending[r.request_id] = result.beam_topk
            n = advance_beams(group, self.scheduler, self.new_seq, self.structured.accept, self.structured.fork,
                              self.max_model_len)
            return ([] if group.is_finished else None), n
        group.fork_samples(r, children, self.scheduler)  # they share the prompt's blocks
        completions, num_out = [], 0
        for seq, toks in zip([r, *children], [result.tokens, *([t] for t in result.fork_samples)]):
            out = self.append_tokens(seq, toks)
            num_out += len(out.new_token_ids)
            completions.append(out)
        if s.spec_token_ids:
            self.spec.observe(r, result.num_draft_tokens, result.num_accepted_tokens)
            self.scheduler.rollback_rejected(r, result.num_accepted_tokens)  # frees the rejected drafts' slots
        return completions, num_out

    def append_tokens(self, r: Request, toks: list[SampledToken]) -> CompletionOutput:
        """Append a step's tokens one by one (several after a verify step), stopping at the first that
        ends the request: nothing past max_tokens, a stop token or a stop string is emitted."""
        new_text, new_ids = "", []
        for tok in toks:
            r.append_output_token(tok.token_id)
            r.cumulative_logprob += tok.logprob
            new_ids.append(tok.token_id)
            if r.sampling_params.logprobs is not None:
                r.output_logprobs.append(tok.logprob)
                r.output_top_logprobs.append(tok.top_logprobs or [])
            delta = r.detokenizer.add_tokens([tok.token_id])
            status = self.stop_status(r, tok.token_id, delta.stop_hit, self.structured.accept(r, tok.token_id))
            new_text += delta.text
            if status is not None:
                if delta.stop_hit is None:
                    new_text += r.detokenizer.finish()
                self.scheduler.finish_request(r, status)
                break
        out = completion(r, r.sample_index, new_text, new_ids)
        if out.finish_reason is not None:  # streamed: its last chunk carries the check
            self.check_schema(r.sampling_params, out)
        return out

    @staticmethod
    def check_schema(params: SamplingParams, out: CompletionOutput) -> None:
        """A sample that ended "stop" under a JSON Schema enforced only in part: checked against the whole
        schema, and how it breaks it reported on the output (schema_check.py)."""
        if out.finish_reason == "stop":
            out.schema_violations = violations(params.structured_outputs, out.text)

    def stop_status(self, r: Request, token_id: int, stop_hit: str | None,
                    grammar_done: bool | None = None) -> RequestStatus | None:
        p = r.sampling_params
        if grammar_done:  # the grammar takes no more tokens (min_tokens cannot be honoured past it)
            r.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if r.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token_id in r.eos_token_ids:
                r.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if p.stop_token_ids and token_id in p.stop_token_ids:
                r.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if stop_hit is not None:
                r.stop_reason = stop_hit
                return RequestStatus.FINISHED_STOPPED
        if r.num_output_tokens >= p.max_tokens or r.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def collect(self, groups: dict[str, SequenceGroup],
                changed: dict[str, list[CompletionOutput]]) -> list[RequestOutput]:
        """One RequestOutput per group that moved: its new deltas, or its final outputs when it is done (then
        it leaves `groups`)."""
        outputs = []
        for rid, completions in changed.items():
            group = groups.get(rid)
            if group is None:
                continue
            if group.is_finished:
                del groups[rid]
                final = group.final_completions(self.decode)
                if group.beam is None and group.params.n == len(group.seqs) * group.copies:  # streamed: keep deltas
                    deltas = {c.index: c for c in completions}
                    for c in final:
                        if c.index in deltas:
                            c.new_text, c.new_token_ids = deltas[c.index].new_text, deltas[c.index].new_token_ids
                for c in final:
                    self.check_schema(group.params, c)
                outputs.append(group_output(group, final, finished=True))
                self.events.ended("request.finished", group.first, rid, group)
            elif group.beam is None and (group.params.best_of or group.params.n) == group.params.n:
                outputs.append(group_output(group, completions, finished=False))
            else:
                continue
            so = group.params.structured_outputs
            if so is not None and so.warnings:
                outputs[-1].warnings = list(so.warnings)
        return outputs
