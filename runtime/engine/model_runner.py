"""ModelRunner: turns a SchedulerOutput into the model's flat batch, runs it, and samples.

It owns the KV cache arrays. Copy-on-write copies the block manager queued are applied before the
forward pass, because the forward writes new K/V into the fresh copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedserve.cupy_kernels.cuda import ops as cuda_ops
from pagedserve.cupy_kernels.backend import to_host
from pagedserve.models.batch import SeqChunk, build_forward_batch

from ..executor import Executor
from ..core.kv_cache_manager import KVCacheManager
from ..sample.rejection_sampler import RejectionSampler
from ..sample.sampler import Sampler
from ..core.scheduler import SchedulerOutput
from ..worker.worker import ExecuteModelRequest

if TYPE_CHECKING:
    from ..structured_output.manager import StructuredOutputManager


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None


@dataclass
class StepResult:
    """What one scheduled sequence got from a step whose chunk reached the end of its tokens."""

    # The sequence's new tokens: one, or after a speculative verify step the accepted drafts and then
    # the target's own next token (so 1 .. k + 1 of them).
    tokens: list[SampledToken] = field(default_factory=list)
    fork_samples: list[SampledToken] = field(default_factory=list)  # first token of each sample forked from it
    beam_topk: tuple[np.ndarray, np.ndarray] | None = None  # beam search: (token ids, logprobs), best first
    error: Exception | None = None  # preparing or sampling this sequence raised; the engine fails its request
    error_stage: str = "sample"  # "prepare" | "sample"
    num_draft_tokens: int = 0  # drafts verified this step
    num_accepted_tokens: int = 0  # of which accepted (tokens[:num_accepted_tokens] are those drafts)


class ModelRunner:
    """The driver's half of a step: scheduled sequences -> one flat batch -> the executor (its workers run
    the forward) -> logits -> samples. The sampler runs once, here, whatever the number of ranks."""

    def __init__(self, executor: Executor, kv_manager: KVCacheManager, sampler: Sampler,
                 structured: StructuredOutputManager | None = None) -> None:
        self.executor = executor
        self.kv = kv_manager
        self.sampler = sampler
        self.rejection_sampler = RejectionSampler(sampler.generator)  # verify steps of speculative decoding
        backend = executor.driver_worker.backend
        self.structured = structured  # the engine's: the token bitmasks of guided rows
        # The sampler's array module: numpy as before, or CuPy with greedy rows through argmax_rows.
        self.xp = _DeviceArrayModule(backend.xp) if backend.is_gpu else np
        self.lora = None  # runtime/lora/manager.py LoRAManager (enable_lora): each sequence's adapter slot

    # The driver worker's model, KV pool and decode graphs (tests and benchmarks look at them).
    @property
    def model(self) -> Any:
        return self.executor.driver_worker.model

    @property
    def kv_caches(self) -> list[tuple[Any, Any]]:
        return self.executor.driver_worker.kv_caches

    @property
    def graphs(self) -> Any:
        return self.executor.driver_worker.graphs

    @graphs.setter
    def graphs(self, graphs: Any) -> None:
        self.executor.driver_worker.graphs = graphs

    def execute(self, sched: SchedulerOutput, forks: dict[int, list] | None = None) -> list[StepResult | None]:
        """One forward pass. Entry i is for sched.scheduled[i]: None mid-prefill, else its samples
        (its own and those of `forks[i]`, the samples about to fork from it) or beam proposals."""
        forks = forks or {}
        chunks, completing, first_rows = [], [], []
        results: list[StepResult | None] = [None] * len(sched.scheduled)
        num_rows = 0
        for i, s in enumerate(sched.scheduled):
            r = s.request
            start = r.num_computed_tokens
            num_real = s.num_real_tokens  # the sequence's own tokens, then its drafts
            completes = s.completes_prompt
            num_logits = 1 + len(s.spec_token_ids) if completes else 0
            try:
                tables = self.kv.block_tables(r.request_id)  # one per KV cache group
                lora_slot = -1 if r.lora_request is None else self.lora.slot_for(r.request_id, r.lora_request)
                chunk = SeqChunk(r.all_token_ids[start : start + num_real] + s.spec_token_ids, start, tables[0],
                                 num_logits=num_logits, group_block_tables=tables[1:], prompt_len=r.num_prompt_tokens,
                                 lora_slot=lora_slot)
            except Exception as e:  # this sequence alone leaves the batch
                results[i] = StepResult(error=e, error_stage="prepare")
                continue
            chunks.append(chunk)
            if completes:
                completing.append(i)
                first_rows.append(num_rows)
                num_rows += num_logits
        groups = self.executor.driver_worker.kv_groups
        batch = build_forward_batch(chunks, self.kv.block_size, groups.layer_group if self.kv.num_groups > 1 else ())
        rows, seqs, owners = [], [], []  # sampler rows: logits row, sequence, scheduled index
        beams = []  # (first logits row, scheduled index) of beams proposing their next tokens
        verify = []  # speculating sequences: scheduled index, first logits row
        for row, i in zip(first_rows, completing):
            r = sched.scheduled[i].request
            if r.group is not None and r.group.beam is not None:
                beams.append((row, i))
                continue
            if sched.scheduled[i].spec_token_ids:
                verify.append((i, row))
                continue
            for seq in [r, *forks.get(i, [])]:
                rows.append(row)
                seqs.append(seq)
                owners.append(i)
        # Structured outputs: the grammar masks (sampler rows, then beams, then the 1 + k rows of each
        # speculating sequence) are filled in a worker thread while the forward runs.
        masked = seqs + [sched.scheduled[i].request for _, i in beams] + [sched.scheduled[i].request for i, _ in verify]
        drafts = [[]] * (len(seqs) + len(beams)) + [sched.scheduled[i].spec_token_ids for i, _ in verify]
        bitmask = self.structured.start_bitmask(masked, drafts) if self.structured is not None else None
        updates = self.lora.take_updates() if self.lora is not None else []
        logits = self.executor.execute_model(ExecuteModelRequest(batch, sched.blocks_to_copy, updates))
        bitmask = bitmask.result() if bitmask is not None else None
        for k, (row, i) in enumerate(beams):
            width = 2 * sched.scheduled[i].request.group.beam.beam_width
            allowed = (bitmask.allowed(bitmask.layout.rows(len(seqs) + k).start, logits.shape[1])
                       if bitmask is not None else None)
            results[i] = StepResult(beam_topk=self._beam_topk(logits[row], width, allowed))
        if verify:
            first = len(seqs) + len(beams)  # the speculating sequences' place among the masked ones
            self._verify(sched, logits, verify, results,
                         bitmask.select(bitmask.layout.rows(first, first + len(verify) - 1))
                         if bitmask is not None else None)
        if not rows:
            return results
        banned = [_banned_ids(r) for r in seqs]
        try:
            picked = self._sample(logits, rows, seqs, banned, rows == list(range(int(logits.shape[0]))),
                                  bitmask.take(len(seqs)) if bitmask is not None else None)
        except Exception:  # find the row(s) at fault: sample each alone, fail only those that raise
            picked = []
            for k in range(len(rows)):
                try:
                    picked += self._sample(logits, rows[k : k + 1], seqs[k : k + 1], banned[k : k + 1], False,
                                           bitmask.select([k]) if bitmask is not None else None)
                except Exception as e:
                    picked.append(e)
        for k, i in enumerate(owners):  # a sequence's own token first, then those of the samples forking from it
            if isinstance(picked[k], Exception):
                results[i] = results[i] or StepResult()
                results[i].error = results[i].error or picked[k]
            elif results[i] is None:
                results[i] = StepResult([picked[k]])
            else:
                results[i].fork_samples.append(picked[k])
        return results

    def _sample(self, logits, rows: list[int], seqs: list, banned: list[list[int]], all_rows: bool,
                grammar_bitmask: Any) -> list[SampledToken]:
        out = self.sampler(
            logits if all_rows else logits[self.xp.asarray(np.asarray(rows))],
            [r.sampling_params for r in seqs],
            [r.generator for r in seqs],
            [r.prompt_token_ids for r in seqs],
            [r.output_token_ids for r in seqs],
            xp=self.xp,
            banned_token_ids=banned if any(banned) else None,
            grammar_bitmask=grammar_bitmask,
        )
        token_ids = np.asarray(out.token_ids).tolist()
        logprobs = np.asarray(out.logprobs).tolist()
        return [SampledToken(token_ids[k], logprobs[k], out.top_logprobs[k] if out.top_logprobs is not None else None)
                for k in range(len(seqs))]

    def _verify(self, sched: SchedulerOutput, logits: Any, verify: list[tuple[int, int]],
                results: list[StepResult | None], grammar_bitmask: Any = None) -> None:
        """Rejection-sample the drafts of the speculating sequences (their 1 + k rows each; grammar_bitmask:
        the guided ones' masks, rows numbered like those rows)."""
        scheduled = [sched.scheduled[i] for i, _ in verify]
        rows = np.concatenate([row + np.arange(1 + len(s.spec_token_ids)) for (_, row), s in zip(verify, scheduled)])
        outs = self.rejection_sampler(
            logits[self.xp.asarray(rows)], [s.request for s in scheduled], [s.spec_token_ids for s in scheduled],
            [s.request.spec_draft_probs for s in scheduled], xp=self.xp, grammar_bitmask=grammar_bitmask)
        for (i, _), s, o in zip(verify, scheduled, outs):
            tokens = [SampledToken(t, lp, top) for t, lp, top in zip(o.token_ids, o.logprobs, o.top_logprobs)]
            results[i] = StepResult(tokens, num_draft_tokens=len(s.spec_token_ids), num_accepted_tokens=o.num_accepted)

    @staticmethod
    def _beam_topk(logits_row, k: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """allowed (structured outputs): only these tokens are proposed, with their raw logprobs."""
        row = to_host(logits_row).astype(np.float64)
        logprobs = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        if allowed is not None:
            logprobs = np.where(allowed, logprobs, -np.inf)
            k = min(k, int(allowed.sum()))
        k = min(k, row.shape[0])
        top = np.argpartition(-logprobs, k - 1)[:k]
        top = top[np.lexsort((top, -logprobs[top]))]  # best first; ties: the lower token id
        return top, logprobs[top]


def _banned_ids(request) -> list[int]:
    """Until min_tokens are out, end-of-sequence and stop tokens may not be sampled."""
    return request.banned_token_ids()


class _DeviceArrayModule:
    """CuPy for the sampler, except that row-wise argmax of float logits (the greedy rows) runs as
    cuda_ops.argmax_rows: numpy's rule for ties and NaN, one CTA per row. Only the sampled token ids
    and their logprobs (and requested top logprobs) are copied back to the host."""

    def __init__(self, xp: Any) -> None:
        self._xp = xp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._xp, name)

    def argmax(self, a: Any, axis: int | None = None, **kwargs: Any) -> Any:
        if (axis == 1 and not kwargs and a.ndim == 2 and a.shape[0] and a.shape[1]
                and np.dtype(a.dtype) in cuda_ops.STORAGE_TYPES):
            return cuda_ops.argmax_rows(a)
        return self._xp.argmax(a, axis=axis, **kwargs)
