"""ModelRunner: turns a SchedulerOutput into the model's flat batch, runs it, and samples.

It owns the KV cache arrays. Copy-on-write copies the block manager queued are applied before the
forward pass, because the forward writes new K/V into the fresh copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedserve.cupy_kernels import cuda_ops
from pagedserve.models.batch import SeqChunk, build_forward_batch

from .executor import Executor
from .kv_cache_manager import KVCacheManager
from .rejection_sampler import RejectionSampler
from .sampler import Sampler
from .scheduler import SchedulerOutput
from .worker import ExecuteModelRequest


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
    num_draft_tokens: int = 0  # drafts verified this step
    num_accepted_tokens: int = 0  # of which accepted (tokens[:num_accepted_tokens] are those drafts)


class ModelRunner:
    """The driver's half of a step: scheduled sequences -> one flat batch -> the executor (its workers run
    the forward) -> logits -> samples. The sampler runs once, here, whatever the number of ranks."""

    def __init__(self, executor: Executor, kv_manager: KVCacheManager, sampler: Sampler) -> None:
        self.executor = executor
        self.kv = kv_manager
        self.sampler = sampler
        self.rejection_sampler = RejectionSampler(sampler.generator)  # verify steps of speculative decoding
        backend = executor.driver_worker.backend
        # The sampler's array module: numpy as before, or CuPy with greedy rows through argmax_rows.
        self.xp = _DeviceArrayModule(backend.xp) if backend.is_gpu else np

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
        copies = self.kv.take_pending_copies()
        chunks, completing, first_rows = [], [], []
        num_rows = 0
        for i, s in enumerate(sched.scheduled):
            r = s.request
            start = r.num_computed_tokens
            num_real = s.num_new_tokens - len(s.spec_token_ids)  # the sequence's own tokens, then its drafts
            completes = start + num_real == r.num_tokens
            num_logits = 1 + len(s.spec_token_ids) if completes else 0
            chunks.append(SeqChunk(r.all_token_ids[start : start + num_real] + s.spec_token_ids, start,
                                   self.kv.block_table(r.request_id), num_logits=num_logits))
            if completes:
                completing.append(i)
                first_rows.append(num_rows)
                num_rows += num_logits
        batch = build_forward_batch(chunks, self.kv.block_size)
        logits = self.executor.execute_model(ExecuteModelRequest(batch, copies))
        results: list[StepResult | None] = [None] * len(sched.scheduled)
        rows, seqs, owners = [], [], []  # sampler rows: logits row, sequence, scheduled index
        verify = []  # speculating sequences: scheduled index, first logits row
        for row, i in zip(first_rows, completing):
            r = sched.scheduled[i].request
            if r.group is not None and r.group.beam is not None:
                results[i] = StepResult(beam_topk=self._beam_topk(logits[row], 2 * r.group.beam.beam_width))
                continue
            if sched.scheduled[i].spec_token_ids:
                verify.append((i, row))
                continue
            for seq in [r, *forks.get(i, [])]:
                rows.append(row)
                seqs.append(seq)
                owners.append(i)
        if verify:
            self._verify(sched, logits, verify, results)
        if not rows:
            return results
        banned = [_banned_ids(r) for r in seqs]
        out = self.sampler(
            logits[self.xp.asarray(np.asarray(rows))] if rows != list(range(int(logits.shape[0]))) else logits,
            [r.sampling_params for r in seqs],
            [r.generator for r in seqs],
            [r.prompt_token_ids for r in seqs],
            [r.output_token_ids for r in seqs],
            xp=self.xp,
            banned_token_ids=banned if any(banned) else None,
        )
        token_ids = np.asarray(out.token_ids).tolist()
        logprobs = np.asarray(out.logprobs).tolist()
        for k, i in enumerate(owners):
            top = out.top_logprobs[k] if out.top_logprobs is not None else None
            tok = SampledToken(token_ids[k], logprobs[k], top)
            if results[i] is None:
                results[i] = StepResult([tok])
            else:
                results[i].fork_samples.append(tok)
        return results

    def _verify(self, sched: SchedulerOutput, logits: Any, verify: list[tuple[int, int]],
                results: list[StepResult | None]) -> None:
        """Rejection-sample the drafts of the speculating sequences (their 1 + k rows each)."""
        scheduled = [sched.scheduled[i] for i, _ in verify]
        rows = np.concatenate([row + np.arange(1 + len(s.spec_token_ids)) for (_, row), s in zip(verify, scheduled)])
        outs = self.rejection_sampler(
            logits[self.xp.asarray(rows)], [s.request for s in scheduled], [s.spec_token_ids for s in scheduled],
            [s.request.spec_draft_probs for s in scheduled], xp=self.xp)
        for (i, _), s, o in zip(verify, scheduled, outs):
            tokens = [SampledToken(t, lp, top) for t, lp, top in zip(o.token_ids, o.logprobs, o.top_logprobs)]
            results[i] = StepResult(tokens, num_draft_tokens=len(s.spec_token_ids), num_accepted_tokens=o.num_accepted)

    @staticmethod
    def _beam_topk(logits_row, k: int) -> tuple[np.ndarray, np.ndarray]:
        row = np.asarray(logits_row.get() if hasattr(logits_row, "get") else logits_row, dtype=np.float64)
        logprobs = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
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
