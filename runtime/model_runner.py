"""ModelRunner: turns a SchedulerOutput into the model's flat batch, runs it, and samples.

It owns the KV cache arrays. Copy-on-write copies the block manager queued are applied before the
forward pass, because the forward writes new K/V into the fresh copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedserve.cupy_kernels.paged_attention import copy_blocks
from pagedserve.models.batch import SeqChunk, build_forward_batch
from pagedserve.models.llama import LlamaForCausalLM

from .kv_cache_manager import KVCacheManager
from .sampler import Sampler
from .scheduler import SchedulerOutput


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[Any, Any]], kv_manager: KVCacheManager,
                 sampler: Sampler) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.kv = kv_manager
        self.sampler = sampler

    def execute(self, sched: SchedulerOutput) -> list[SampledToken | None]:
        """One forward pass; entry i is the token sampled for sched.scheduled[i] (None mid-prefill)."""
        copy_blocks(self.kv_caches, self.kv.take_pending_copies())
        chunks, sampling_rows = [], []
        for i, s in enumerate(sched.scheduled):
            r = s.request
            start = r.num_computed_tokens
            completes = start + s.num_new_tokens == r.num_tokens
            chunks.append(SeqChunk(r.all_token_ids[start : start + s.num_new_tokens], start,
                                   self.kv.block_table(r.request_id), needs_logits=completes))
            if completes:
                sampling_rows.append(i)
        batch = build_forward_batch(chunks, self.kv.block_size)
        logits = self.model.forward(batch, self.kv_caches)
        results: list[SampledToken | None] = [None] * len(sched.scheduled)
        if not sampling_rows:
            return results
        requests = [sched.scheduled[i].request for i in sampling_rows]
        banned = [_banned_ids(r) for r in requests]
        out = self.sampler(
            logits,
            [r.sampling_params for r in requests],
            [r.generator for r in requests],
            [r.prompt_token_ids for r in requests],
            [r.output_token_ids for r in requests],
            banned_token_ids=banned if any(banned) else None,
        )
        token_ids = np.asarray(out.token_ids).tolist()
        logprobs = np.asarray(out.logprobs).tolist()
        for row, i in enumerate(sampling_rows):
            top = out.top_logprobs[row] if out.top_logprobs is not None else None
            results[i] = SampledToken(token_ids[row], logprobs[row], top)
        return results


def _banned_ids(request) -> list[int]:
    """Until min_tokens are out, end-of-sequence and stop tokens may not be sampled."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids or [])
    if not params.ignore_eos:
        banned += list(request.eos_token_ids)
    return banned
