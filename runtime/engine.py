"""LLMEngine: requests in, per-step outputs out. The step is schedule, run, update."""

from __future__ import annotations

import time
from collections import deque
from typing import Iterable, Sequence

import numpy as np
import structlog

from pagedserve.cupy_kernels.backend import get_backend
from pagedserve.models.kv_cache import allocate_kv_caches, kv_bytes_per_block
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.loader import LoadedModel, load_model

from .config import DEFAULT_CPU_KV_BYTES, EngineConfig
from .detokenizer import IncrementalDetokenizer
from .kv_cache_manager import KVCacheManager
from .model_runner import ModelRunner, SampledToken
from .outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from .request import Request, RequestStatus
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput

log = structlog.get_logger("pagedserve.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        loaded = loaded or load_model(config.model, use_cache=config.use_weight_cache)
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.backend = get_backend(config.device)
        self.model = LlamaForCausalLM(loaded.config, loaded.weights, self.backend, source=str(loaded.path))
        self.max_model_len = config.max_model_len or loaded.config.max_position_embeddings
        if self.max_model_len > loaded.config.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({loaded.config.max_position_embeddings})")
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"with chunked prefill off, max_num_batched_tokens ({config.max_num_batched_tokens}) "
                             f"must be >= max_model_len ({self.max_model_len}) or long prompts could never run")
        self.block_size = config.block_size
        num_blocks = self._num_kv_blocks()
        self.num_kv_blocks = num_blocks
        self.kv_manager = KVCacheManager(num_blocks, self.block_size)
        kv_caches = allocate_kv_caches(loaded.config, num_blocks, self.block_size, self.backend)
        self.runner = ModelRunner(self.model, kv_caches, self.kv_manager, Sampler(config.seed))
        self.scheduler = Scheduler(self.kv_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.enable_chunked_prefill)
        self.requests: dict[str, Request] = {}
        self._throughput: deque[tuple[float, int, int]] = deque()  # (time, output tokens, all tokens)
        self.num_preemptions = 0
        log.info("engine.kv_pool", num_blocks=num_blocks, block_size=self.block_size,
                 num_token_slots=num_blocks * self.block_size, backend=self.backend.name,
                 model=self.model_name)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.backend.dtype.itemsize)
        if self.backend.is_gpu:
            free, total = self.backend.xp.cuda.runtime.memGetInfo()
            budget = int(total * self.config.gpu_memory_utilization) - (total - free)
        else:
            budget = self.config.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget of {budget} bytes holds no block of {per_block} bytes")
        return int(num_blocks)

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> Request:
        """Validate and queue a request; raises ValueError with a precise message on bad input."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = self.make_request(request_id, prompt, params, arrival_time)
        self.add_prepared(request)
        return request

    def make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     arrival_time: float | None = None) -> Request:
        """Validate a request and build it, touching no engine state (safe from another thread)."""
        params = params or SamplingParams()
        if params.n != 1 or (params.best_of or 1) != 1:
            raise ValueError("n and best_of > 1 (parallel sampling) are not supported yet; send n separate requests")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size}); got {bad[:5]}")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len ({self.max_model_len})")
        needed = -(-(len(ids) + params.max_tokens) // self.block_size)
        if needed > self.num_kv_blocks:
            raise ValueError(f"prompt plus max_tokens needs {needed} KV blocks but the whole pool has "
                             f"{self.num_kv_blocks}; lower max_tokens or enlarge the KV cache")
        generator = np.random.default_rng(params.seed) if params.seed is not None else None
        request = Request(request_id, ids, params, arrival_time or time.monotonic(),
                          eos_token_ids=self.model_config.eos_token_ids, prompt=text, generator=generator)
        request.detokenizer = IncrementalDetokenizer(
            self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)
        return request

    def add_prepared(self, request: Request) -> None:
        """Queue a request built by make_request."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)
        if self.config.log_requests is not None:
            fields = {"prompt": request.prompt} if self.config.log_requests and request.prompt is not None else {}
            log.info("request.queued", request_id=request.request_id, prompt_tokens=request.num_prompt_tokens,
                     max_tokens=request.sampling_params.max_tokens, **fields)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests; their blocks are freed at once. Unknown or finished ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.pop(rid, None)
            if request is not None:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
                self._log_end("request.aborted", request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self._note_preemptions(sched)
        if sched.is_empty:
            return []
        sampled = self.runner.execute(sched)
        return self._update(sched, sampled)

    def _note_preemptions(self, sched: SchedulerOutput) -> None:
        self.num_preemptions += len(sched.preempted)
        if self.config.log_requests is None:
            return
        for r in sched.preempted:
            log.info("request.preempted", request_id=r.request_id, output_tokens=r.num_output_tokens,
                     num_preemptions=r.num_preemptions)
        for s in sched.scheduled:
            t = s.request.timings
            if t.first_scheduled is not None and s.request.num_computed_tokens == 0 and not s.request.num_preemptions:
                log.info("request.scheduled", request_id=s.request.request_id,
                         queue_time_s=round(t.first_scheduled - t.arrival, 6), num_new_tokens=s.num_new_tokens)

    def _log_end(self, event: str, r: Request) -> None:
        if self.config.log_requests is None:
            return
        t = r.timings
        fields = {}
        if t.first_token is not None:
            fields["ttft_s"] = round(t.first_token - t.arrival, 6)
            if r.num_output_tokens > 1 and t.finished is not None:
                fields["tpot_s"] = round((t.finished - t.first_token) / (r.num_output_tokens - 1), 6)
        if t.first_scheduled is not None:
            fields["queue_time_s"] = round(t.first_scheduled - t.arrival, 6)
        if self.config.log_requests:
            fields["output"] = r.detokenizer.output_text
        log.info(event, request_id=r.request_id, finish_reason=r.finish_reason, prompt_tokens=r.num_prompt_tokens,
                 completion_tokens=r.num_output_tokens, cached_tokens=r.num_cached_tokens,
                 e2e_s=round((t.finished or time.monotonic()) - t.arrival, 6), **fields)

    def _update(self, sched: SchedulerOutput, sampled: list[SampledToken | None]) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        num_out = 0
        for s, tok in zip(sched.scheduled, sampled):
            r = s.request
            r.num_computed_tokens += s.num_new_tokens
            if tok is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            num_out += 1
            if r.timings.first_token is None:
                r.timings.first_token = now
                if self.config.log_requests is not None:
                    log.info("request.first_token", request_id=r.request_id,
                             ttft_s=round(now - r.timings.arrival, 6))
            r.append_output_token(tok.token_id)
            r.cumulative_logprob += tok.logprob
            if r.sampling_params.logprobs is not None:
                r.output_logprobs.append(tok.logprob)
                r.output_top_logprobs.append(tok.top_logprobs or [])
            delta = r.detokenizer.add_tokens([tok.token_id])
            status = self._stop_status(r, tok.token_id, delta.stop_hit)
            new_text = delta.text
            if status is not None:
                if delta.stop_hit is None:
                    new_text += r.detokenizer.finish()
                self.requests.pop(r.request_id, None)
                self.scheduler.finish_request(r, status)
                self._log_end("request.finished", r)
            outputs.append(self._make_output(r, new_text, [tok.token_id]))
        self._throughput.append((now, num_out, sched.num_batched_tokens))
        return outputs

    def _stop_status(self, r: Request, token_id: int, stop_hit: str | None) -> RequestStatus | None:
        p = r.sampling_params
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

    def _make_output(self, r: Request, new_text: str, new_ids: list[int]) -> RequestOutput:
        logprobs = None
        if r.sampling_params.logprobs is not None:
            logprobs = [{r.output_token_ids[i]: lp, **dict(top)} for i, (lp, top)
                        in enumerate(zip(r.output_logprobs, r.output_top_logprobs))]
        completion = CompletionOutput(
            index=0, text=r.detokenizer.output_text, token_ids=list(r.output_token_ids),
            cumulative_logprob=r.cumulative_logprob, logprobs=logprobs, finish_reason=r.finish_reason,
            stop_reason=r.stop_reason, new_text=new_text, new_token_ids=new_ids)
        t = r.timings
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, [completion], r.is_finished,
                             RequestMetrics(t.arrival, t.first_scheduled, t.first_token, t.finished),
                             r.num_cached_tokens)

    # -- observability ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise if the block pool's ref counts disagree with the live block tables."""
        self.kv_manager.check_integrity()

    def get_stats(self, window_s: float = 10.0) -> EngineStats:
        now = time.monotonic()
        while self._throughput and now - self._throughput[0][0] > window_s:
            self._throughput.popleft()
        span = now - self._throughput[0][0] if len(self._throughput) > 1 else 0.0
        out_tps = sum(x[1] for x in self._throughput) / span if span > 0 else 0.0
        all_tps = sum(x[2] for x in self._throughput) / span if span > 0 else 0.0
        usage = self.kv_manager.usage()
        held = sum(r.num_computed_tokens for r in self.scheduler.running)
        slots = usage.num_used_blocks * self.block_size
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), usage.num_used_blocks,
                           usage.num_blocks, held / slots if slots else 0.0, out_tps, all_tps,
                           self.num_preemptions)
