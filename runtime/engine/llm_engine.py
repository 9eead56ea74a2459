"""LLMEngine: requests in, per-step outputs out. The step is schedule, run, update."""

from __future__ import annotations

import os
import time
from typing import Iterable, Sequence

import structlog

from pagedserve.cupy_kernels import OPENBLAS_ENV_APPLIED
from pagedserve.cupy_kernels.host.blas_threads import STARTED_BLAS_THREADS, blas_info, set_cpu_threads
from pagedserve.cupy_kernels.kernel_set import numba_code_path
from pagedserve.models.loading.loader import LoadedModel, load_model
from pagedserve.models.rope import longrope_threshold

from ..config import EngineConfig
from .cpu_threads_tuner import CpuThreadsTuner
from ..executor import WorkerFailedError, make_executor
from ..core.kv_cache_manager import KVCacheManager
from ..worker.memory_budget import check_engine_memory
from ..core.beam_search import BeamSearchParams
from ..kv_transfer.kv_connector import KVBlockIO, KVConnector, KVTransferSpec, KVTransferStats, transfer_spec
from .input_processor import InputProcessor
from .model_runner import ModelRunner, StepResult
from .output_processor import OutputProcessor
from ..outputs import CompletionOutput, EngineStats, RequestOutput
from ..core.request import Request, RequestStatus
from ..core.sched_policy import make_policy
from ..kv_transfer.remote_prefill import RemotePrefill, export_blocks
from .request_events import RequestEvents
from .stats import Throughput, engine_stats
from .request_limits import RequestLimits, ServerShape
from ..sample.sampler import Sampler
from ..sampling_params import SamplingParams
from ..core.chunking import keys_per_token
from ..core.scheduler import Scheduler, SchedulerOutput
from ..structured_output.manager import StructuredOutputManager
from ..spec_decode.decoder import build_spec_decoder
from ..core.sequence_group import SequenceGroup, completion, group_output
from ..lora.engine_hooks import LoRARequest, check_lora_request, make_lora_manager, register_lora_request

log = structlog.get_logger("pagedserve.engine")

_STAGES = {"schedule": "scheduling it", "prepare": "preparing it", "forward": "running the forward pass of its batch",
           "sample": "sampling its next token", "update": "updating and detokenizing its output"}


def _present(outputs: list[RequestOutput | None]) -> list[RequestOutput]:
    return [o for o in outputs if o is not None]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        # The workers (one per tensor-parallel rank) load the model, pick the backend and hold the KV pool.
        self.executor = make_executor(config, loaded)
        try:
            self._init_after_workers(config, loaded)
        except BaseException:
            self.executor.shutdown()
            raise

    def _init_after_workers(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        worker = self.executor.driver_worker
        self.model_name = worker.model_name
        self.model_config = worker.model_config
        self.tokenizer = worker.tokenizer
        self.backend = worker.backend
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({self.model_config.max_position_embeddings})")
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"with chunked prefill off, max_num_batched_tokens ({config.max_num_batched_tokens}) "
                             f"must be >= max_model_len ({self.max_model_len}) or long prompts could never run")
        self.block_size = config.block_size
        num_blocks = config.num_kv_blocks or self.executor.determine_num_kv_blocks(self.max_model_len)
        self.num_kv_blocks = num_blocks
        self.memory_budget = check_engine_memory(config, self.model_config, self.executor.driver_worker,
                                                 self.backend, num_blocks, self.max_model_len)
        self.limits = RequestLimits(max_logprobs=config.max_logprobs)
        # With KV cache groups a sequence may hold a block in every group (a prompt inside the window does):
        # requests are checked against a group's share of the pool, which is the whole pool of a model
        # without groups (the same bytes hold num_groups times the blocks), so none can outgrow it.
        num_groups = len(self.executor.driver_worker.kv_groups.windows)
        self.shape = ServerShape(self.model_config.vocab_size, self.max_model_len, config.max_num_seqs,
                                 num_blocks if num_groups == 1 else (num_blocks - 1) // num_groups, self.block_size)
        # GPU: decode CUDA graphs are captured now, against these very KV caches.
        self.executor.initialize_cache(num_blocks, self.max_model_len)
        self.kv_manager = KVCacheManager(num_blocks, self.block_size, config.enable_prefix_caching,
                                         self.executor.driver_worker.kv_groups.windows,
                                         longrope_threshold(self.model_config))  # a factor set per prompt length
        # Guided decoding: grammars compile in a worker thread; costs nothing until a request has one.
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size)
        self.runner = ModelRunner(self.executor, self.kv_manager, Sampler(config.seed, self.backend.ops.logsumexp_rows,
                                                                        self.backend.ops.argmax_rows),
                                  self.structured)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.enable_chunked_prefill,
                                   keys_per_token(self.model_config, self.backend.ops.attention_cost)
                                   if config.cost_aware_chunking else None,
                                   make_policy(config.scheduling_policy, config.tenant_weights))
        # Speculative decoding (None = off): proposes drafts after each step; a draft model brings its own pool.
        # A self-draft needs the target's whole weights, which the workers do not keep: loaded again (cached).
        self.spec = build_spec_decoder(
            config.speculative_config, lambda: loaded or load_model(config.model, use_cache=config.use_weight_cache),
            self.backend, num_blocks, self.block_size, self.max_model_len, config.seed, config.use_weight_cache,
            self.structured,  # guided sequences' drafts are checked against their grammar
            kv_storage=self.executor.driver_worker.kv_layout.storage, executor=self.executor)  # executor: calibrate
        if self.spec is not None:
            self.scheduler.release_hooks.append(self.spec.free)
        self.lora = make_lora_manager(config, self.executor.driver_worker.model, self.scheduler, self.runner)
        # cpu_threads="auto": the thread count follows measured step cost (runtime/engine/cpu_threads_tuner.py).
        self.threads_tuner = None
        if config.cpu_threads == "auto" and not self.backend.is_gpu:
            self.threads_tuner = CpuThreadsTuner(
                STARTED_BLAS_THREADS or os.cpu_count() or 1, set_cpu_threads,
                on_switch=lambda old, new, old_cost, new_cost: log.info(
                    "engine.cpu_threads", threads=new, was=old, ms_per_token=round(1e3 * new_cost, 3),
                    was_ms_per_token=round(1e3 * old_cost, 3)))
        self.groups: dict[str, SequenceGroup] = {}
        self.events = RequestEvents(config.log_requests)
        self.throughput = Throughput()
        self.num_preemptions = 0
        # Disaggregated serving (kv_connector.py): blocks in and out of the pool in the wire layout. Under
        # tensor parallelism each rank holds a slice of the heads, so whole blocks are not in one place: off.
        worker = self.executor.driver_worker
        # Blocks of several KV cache groups (sliding-window layers) have no one wire layout yet: off there too.
        whole = self.executor.world_size == 1 and len(worker.kv_groups.windows) == 1
        self.block_io = KVBlockIO(worker.kv_caches, self.backend) if whole else None
        self.kv_stats = KVTransferStats()
        self.remote_prefill: RemotePrefill | None = None  # set on a decode instance
        self.failed_requests: list[tuple[str, Exception]] = []  # taken by the caller after each step
        self.inputs = InputProcessor(self.tokenizer, self.limits, self.shape, self.structured,
                                     self.model_config.eos_token_ids)
        self.outputs = OutputProcessor(
            self.scheduler, self.structured, self.events, self.tokenizer.decode, self.max_model_len,
            self.inputs.new_seq, self.spec, lambda r: export_blocks(r, self.kv_manager, self.block_io, self.kv_stats))
        self.blas = blas_info()  # numpy's BLAS: its kernel ("architecture") and threads, for logs and stats
        self.numba_code_path = None if self.backend.is_gpu else numba_code_path()  # avx512 / avx2 / baseline
        self.kv_layout = worker.kv_layout  # the pool's kv_cache_dtype, "auto" resolved
        log.info("engine.kv_pool", num_blocks=num_blocks, block_size=self.block_size,
                 num_token_slots=num_blocks * self.block_size, kv_cache_dtype=self.kv_layout.dtype,
                 kv_cache_dtype_requested=self.kv_layout.requested, kv_bytes_per_block=worker.kv_bytes_per_block(),
                 backend=self.backend.name,
                 kernels=self.backend.ops.name, model=self.model_name,
                 blas_threads=(self.blas or {}).get("num_threads"), blas_kernel=(self.blas or {}).get("architecture"),
                 numba_code_path=self.numba_code_path,
                 tensor_parallel_size=self.executor.world_size, **worker.malloc,
                 gguf_block_matmuls=worker.model.quantized_matmuls,  # numba: few-row matmuls on GGUF blocks
                 openblas_env_applied=OPENBLAS_ENV_APPLIED)  # False: numpy was imported before pagedserve

    @property
    def cpu_threads(self) -> int | None:
        """Threads the CPU backend runs at now (the tuner's choice under cpu_threads="auto")."""
        if self.threads_tuner is not None:
            return self.threads_tuner.current
        return (self.blas or {}).get("num_threads")

    @property
    def model(self):
        """The driver worker's model (rank 0's shard under tensor parallelism)."""
        return self.executor.driver_worker.model

    @property
    def kv_sizing(self):
        """GPU: the gpu_memory.KVCacheSizing behind the pool's size (rank 0's); None on the CPU."""
        return self.executor.driver_worker.kv_sizing

    def shutdown(self) -> None:
        """Stop the rank processes (tensor parallelism); a no-op for a single rank."""
        self.executor.shutdown()

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None, tenant: str | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> SequenceGroup:
        """Validate and queue a request (ValueError naming what is wrong); a new lora_request is read first."""
        register_lora_request(self.lora, lora_request)
        group = self.make_request(request_id, prompt, params, arrival_time, cache_salt, tenant, priority, lora_request)
        self.add_prepared(group)
        return group

    def add_beam_request(self, request_id: str, prompt: str | Sequence[int], params: BeamSearchParams,
                         arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> SequenceGroup:
        """Queue a beam search; its one finished output carries beam_width completions, best first."""
        register_lora_request(self.lora, lora_request)
        group = self.inputs.make_beam_request(request_id, prompt, params, arrival_time, lora_request)
        self.add_prepared(group)
        return group

    def make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     arrival_time: float | None = None, cache_salt: str | None = None, tenant: str | None = None,
                     priority: int = 0, lora_request: LoRARequest | None = None) -> SequenceGroup:
        """Validate a request and build it, touching no engine state (safe from another thread)."""
        check_lora_request(self.lora, lora_request)
        return self.inputs.make_request(request_id, prompt, params, arrival_time, cache_salt, tenant, priority,
                                        lora_request)

    def add_prepared(self, group: SequenceGroup) -> None:
        """Queue a request built by make_request."""
        if group.request_id in self.groups:
            raise ValueError(f"request_id {group.request_id!r} is already in use")
        self.groups[group.request_id] = group
        if self.remote_prefill is None or not self.remote_prefill.try_start(group.seqs[0]):
            self.scheduler.add_request(group.seqs[0])
        self.events.queued(group.seqs[0])
        if group.grammar is not None:
            self.structured.track(group)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (every sequence of each); their blocks are freed at once. Unknown ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            group.aborted = True
            for seq in group.live:
                if self.remote_prefill is not None:
                    self.remote_prefill.abort(seq.request_id)
                self.scheduler.finish_request(seq, RequestStatus.FINISHED_ABORTED)
            self.events.ended("request.aborted", group.first, rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update. A request whose part of this raises fails alone (its output carries
        `error`, its blocks are freed); a failed forward fails the requests in its batch, no others."""
        failed = self._before_schedule()  # grammars that failed to compile, remote KV that landed
        sched = self.scheduler.schedule()
        forks = self._after_schedule(sched, failed)  # samples to fork this step; requests failed meanwhile
        if sched.is_empty:
            self._wait_for_work(failed)
            return _present(failed)
        results = self._execute(sched, forks, failed)
        if results is None:  # the forward failed: its batch's requests failed, the others wait on
            return _present(failed)
        outputs = _present(failed) + self._update(sched, forks, results)
        if self.spec is not None:  # drafts for the next step, from the tokens just appended
            self.spec.propose(self.scheduler.running)
        return outputs

    def _before_schedule(self) -> list[RequestOutput | None]:
        failed: list[RequestOutput | None] = list(self._fail_bad_grammars())
        if self.remote_prefill is not None:
            self._land_remote_kv()
        return failed

    def _after_schedule(self, sched: SchedulerOutput, failed: list) -> dict[int, list[Request]]:
        self.num_preemptions += len(sched.preempted)
        self.events.scheduled(sched)
        failed += [self._fail_group(r.group, e, "schedule") for r, e in sched.failed]
        if sched.is_empty:
            return {}
        forks = self._plan_forks(sched, failed)
        self._drop_finished(sched, forks)
        return forks

    def _wait_for_work(self, failed: list) -> None:
        if self.scheduler.waiting_for_kv:  # only transfers in flight: wait for one, do not spin
            self.remote_prefill.connector.wait(0.02)
        elif not any(o is not None for o in failed):
            self.structured.wait_for_any(timeout_s=0.05)  # only grammars left to compile: wait, do not spin

    def _execute(self, sched: SchedulerOutput, forks: dict[int, list[Request]],
                 failed: list) -> list[StepResult | None] | None:
        """The forward and sampling; None when the batch failed (its requests are failed into `failed`)."""
        try:
            started = self.spec.clock() if self.spec is not None else 0.0
            if self.threads_tuner is not None:
                self.threads_tuner.before_step()
            results = self.runner.execute(sched, forks)
            if self.threads_tuner is not None:
                self.threads_tuner.after_step(sched.num_batched_tokens)
            if self.spec is not None:  # what steps cost by their rows: the speculation policy's cost side
                self.spec.observe_step(sched.scheduled, sched.num_batched_tokens, self.spec.clock() - started)
            return results
        except WorkerFailedError:  # a rank died: no request can run any more; the async engine stops
            raise
        except Exception as e:  # the batch's forward: every request in it fails, the others wait on
            for s in sched.scheduled:
                failed.append(self._fail_group(s.request.group, e, "forward", forks))
            return None

    def _fail_group(self, group: SequenceGroup | None, error: Exception, stage: str,
                    forks: dict[int, list[Request]] | None = None) -> RequestOutput | None:
        """End a request whose processing raised: every sequence finished, every block freed, one
        final output carrying the error. None if it had already ended (another sequence failed first)."""
        if group is None or self.groups.get(group.request_id) is not group:
            return None
        del self.groups[group.request_id]
        group.aborted = True
        unforked = [c for cs in (forks or {}).values() for c in cs if c.group is group]
        for seq in [*group.live, *unforked]:
            if self.remote_prefill is not None:  # a transfer in flight for it is cancelled too
                self.remote_prefill.abort(seq.request_id)
            self.scheduler.finish_request(seq, RequestStatus.FINISHED_ABORTED)
        group.num_to_fork = 0
        message = f"request failed while {_STAGES[stage]}: {error!r}"
        log.error("request.failed", request_id=group.request_id, stage=stage, error=repr(error))
        self.events.ended("request.aborted", group.first, group.request_id)
        out = group_output(group, [completion(s, s.sample_index) for s in group.seqs[: group.params.n]], finished=True)
        out.error = message
        return out

    def _drop_finished(self, sched: SchedulerOutput, forks: dict[int, list[Request]]) -> None:
        """Take requests failed since scheduling out of the batch (their blocks are already free)."""
        keep = [i for i, s in enumerate(sched.scheduled) if not s.request.is_finished]
        if len(keep) < len(sched.scheduled):
            new_forks = {k: forks[i] for k, i in enumerate(keep) if i in forks}
            sched.scheduled = [sched.scheduled[i] for i in keep]
            forks.clear()
            forks.update(new_forks)

    def _plan_forks(self, sched: SchedulerOutput, failed: list) -> dict[int, list[Request]]:
        """Samples 1.. of n > 1 requests whose prompt completes this step: created now, forked after."""
        forks: dict[int, list[Request]] = {}
        for i, s in enumerate(sched.scheduled):
            r = s.request
            group = r.group
            if group.num_to_fork and r.sample_index == 0 and s.completes_prompt:
                try:
                    forks[i] = [self.inputs.new_seq(group, group.next_seq_id(), k)
                                for k in range(1, group.num_to_fork + 1)]
                except Exception as e:
                    failed.append(self._fail_group(group, e, "prepare"))
        return forks

    def _update(self, sched: SchedulerOutput, forks: dict[int, list[Request]],
                results: list[StepResult | None]) -> list[RequestOutput]:
        """Each scheduled sequence's results through the output processor; one that raises fails its request."""
        now = time.monotonic()
        changed: dict[str, list[CompletionOutput]] = {}
        num_out = 0
        failed: list[RequestOutput | None] = []
        for i, (s, result) in enumerate(zip(sched.scheduled, results)):
            group = s.request.group
            if group.aborted:  # another of its sequences failed earlier in this loop
                continue
            if result is not None and result.error is not None:
                failed.append(self._fail_group(group, result.error, result.error_stage, forks))
                continue
            try:
                completions, appended = self.outputs.update(s, result, forks.get(i, []), now)
            except Exception as e:  # appending, hashing, forking, detokenizing this request
                failed.append(self._fail_group(group, e, "update", forks))
                continue
            num_out += appended
            if completions is not None:
                changed.setdefault(group.request_id, []).extend(completions)
        self.throughput.add(now, num_out, sched.num_batched_tokens)
        return [o for o in failed if o is not None] + self.outputs.collect(self.groups, changed)

    def _fail_bad_grammars(self) -> list[RequestOutput]:
        """Requests whose grammar failed to compile for this tokenizer end aborted (they hold no KV block).
        Validation at construction catches bad constraints; this is for what only the tokenizer shows."""
        outputs = []
        for group, error in self.structured.poll_failed():
            if self.groups.get(group.request_id) is not group:
                continue  # aborted meanwhile
            log.warning("request.grammar_failed", request_id=group.request_id, error=str(error)[:300])
            self.abort_request(group.request_id)
            outputs.append(group_output(group, group.final_completions(self.tokenizer.decode), finished=True))
        return outputs

    # -- disaggregated prefill -------------------------------------------------------------------

    def enable_remote_prefill(self, connector: KVConnector, fallback: str = "local") -> None:
        """Decode role: prompts' full blocks come from a prefill instance through `connector`."""
        if self.block_io is None:
            raise ValueError("disaggregated prefill/decode needs tensor_parallel_size 1")
        self.remote_prefill = RemotePrefill(connector, self.scheduler, self.block_io,
                                            self.kv_stats, fallback)

    def _land_remote_kv(self) -> None:
        for rid, error in self.remote_prefill.poll():
            self.abort_request(rid)
            self.failed_requests.append((rid, error))

    def take_failed_requests(self) -> list[tuple[str, Exception]]:
        failed, self.failed_requests = self.failed_requests, []
        return failed

    def kv_transfer_spec(self, role: str, host_id: str = "") -> KVTransferSpec:  # what a handshake tells the peer
        return transfer_spec(role, host_id, self.model_name, self.model_config, self.model.embed_tokens,
                             self.block_size, self.kv_layout.dtype, self.max_model_len)

    # -- observability ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise if the block pool's ref counts disagree with the live block tables."""
        self.kv_manager.check_integrity()

    def get_stats(self, window_s: float = 10.0) -> EngineStats:
        return engine_stats(self, window_s)
