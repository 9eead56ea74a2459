"""RayExecutor: ranks 1..N-1 as Ray actors (`distributed_executor_backend="ray"`, extra `[ray]`), as vLLM
does for ranks on several hosts. Rank 0 stays in the driver process, as with local processes.

Ray connects to the cluster named by RAY_ADDRESS (or one already initialised in this process), else
starts a local one. GPU ranks each ask Ray for one GPU (Ray sets CUDA_VISIBLE_DEVICES, so an actor's
device is its index 0) and talk over NCCL; CPU ranks talk through shared memory, so they must share the
driver's host (checked at start). Each step's batch is put in Ray's object store once; the driver
waits for every rank's step to finish (bounded by collective_timeout_s), and inside collectives it
polls the ranks' pending calls so a dead actor fails the step at once (RayActorError -> WorkerFailedError).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import structlog

from pagedserve.cupy_kernels.backend import get_backend
from pagedserve.models.loading.loader import LoadedModel

from ..config import EngineConfig
from . import Executor, WorkerFailedError
from .mp_executor import _INIT_TIMEOUT_S, comm_spec, make_comm
from ..worker.worker import ExecuteModelRequest, Worker

log = structlog.get_logger("pagedserve.engine")


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'pagedserve[ray]' "
                         "(or use the default local processes, 'mp')") from None
    return ray


class _RayRank:
    """The body of one rank actor: a Worker plus its end of the collectives."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, spec: tuple) -> None:
        self.comm = make_comm(spec, rank, world_size)
        self.worker = Worker(config, rank, world_size, self.comm, local_device=0)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def call(self, method: str, *args: Any) -> Any:
        try:
            result = getattr(self.worker, method)(*args)
        except BaseException:
            self.comm.abort()  # the other ranks' waits end now, not at their deadline
            raise
        return None if method == "execute_model" else result


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        ray = self.ray = _import_ray()
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS") or None, ignore_reinit_error=True,
                     log_to_driver=False)
        n = config.tensor_parallel_size
        backend = get_backend(config.device)
        self.failure = None
        self.timeout_s = float(config.collective_timeout_s)
        self.pending: list[Any] = []
        self._last_poll = 0.0
        spec = comm_spec(config, backend.is_gpu)
        self.comm = make_comm(spec, 0, n, create=True, liveness=self.check_health)
        self.actors: list[Any] = []
        try:
            self.driver_worker = Worker(config, 0, n, self.comm, loaded, local_device=0)
            if spec[0] == "shm":
                spec = ("shm", self.comm.name, *spec[2:])
            rank_config = dataclasses.replace(config, model=str(self.driver_worker.model_path))
            actor = ray.remote(num_cpus=1, num_gpus=1 if backend.is_gpu else 0)(_RayRank)
            self.actors = [actor.remote(rank_config, r, n, spec) for r in range(1, n)]
            nodes = ray.get([a.node_id.remote() for a in self.actors], timeout=_INIT_TIMEOUT_S)
            here = ray.get_runtime_context().get_node_id()
            if not backend.is_gpu and any(node != here for node in nodes):
                raise ValueError("CPU tensor parallelism talks through shared memory, so every rank must run on "
                                 "the driver's host; across hosts use GPUs (NCCL)")
        except BaseException:
            self.shutdown()
            raise
        log.info("executor.started", backend="ray", tensor_parallel_size=n, collectives=spec[0])

    def _call(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        if self.failure is not None:
            raise WorkerFailedError(f"the engine's ranks failed earlier: {self.failure}")
        ray = self.ray
        ref_args = [ray.put(a) for a in args]  # once in the object store, read by every rank
        self.pending = [a.call.remote(method, *ref_args) for a in self.actors]
        try:
            mine = getattr(self.driver_worker, method)(*args)
            theirs = ray.get(self.pending, timeout=timeout_s)
        except WorkerFailedError as e:
            raise self._fail(e) from e
        except Exception as e:  # noqa: BLE001 - RayActorError, RayTaskError, GetTimeoutError, CollectiveError
            raise self._fail(WorkerFailedError(f"a tensor-parallel rank failed during {method!r}: {e}")) from e
        finally:
            self.pending = []
        return [mine, *theirs]

    def determine_num_kv_blocks(self, max_model_len: int) -> int:
        return min(self._call("determine_num_kv_blocks", max_model_len, timeout_s=_INIT_TIMEOUT_S))

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self._call("initialize_cache", num_blocks, max_model_len, timeout_s=_INIT_TIMEOUT_S)

    def execute_model(self, request: ExecuteModelRequest) -> Any:
        return self._call("execute_model", request, timeout_s=self.timeout_s)[0]

    def check_health(self) -> None:
        """Inside a collective wait: a rank call that already ended (an actor died or raised) fails it."""
        if self.failure is not None:
            raise self.failure
        now = time.monotonic()
        if not self.pending or now - self._last_poll < 0.01:
            return
        self._last_poll = now
        ready, _ = self.ray.wait(self.pending, num_returns=len(self.pending), timeout=0)
        for ref in ready:
            try:
                self.ray.get(ref)
            except Exception as e:  # noqa: BLE001
                raise WorkerFailedError(f"a tensor-parallel rank (Ray actor) failed: {e}") from e

    def _fail(self, error: WorkerFailedError) -> WorkerFailedError:
        if self.failure is None:
            self.comm.abort()
            self.failure = error
            log.error("executor.rank_failed", error=str(error))
        return self.failure

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        self.comm.close()
