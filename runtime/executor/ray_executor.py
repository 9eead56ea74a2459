"""RayExecutor: ranks 1..N-1 as Ray actors (`distributed_executor_backend="ray"`, extra `[ray]`), as vLLM
does for ranks on several hosts. Rank 0 stays in the driver process, as with local processes.

Ray connects to the cluster named by RAY_ADDRESS, or uses the one already initialised in this process,
else starts a local one (stopped again at shutdown). Where ranks run is decided first, in one placement
group (ray_placement.py): on CPU every rank on the driver's node, since CPU ranks talk through shared
memory; on GPUs one GPU per rank, packed on the driver's node and spread only when it has too few, and
talking over NCCL. Too few resources is a ValueError naming them, before any weights load. The
`executor.started` log line carries the rank-to-node map and the rank actors' pids.

Each step's batch goes to each rank inside its call; the driver waits for every rank's step to finish
(bounded by collective_timeout_s), and inside collectives it polls the ranks' pending calls, so a dead
actor or node fails the step at once (ActorDiedError -> WorkerFailedError naming the rank).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any

import structlog

from pagedserve.cupy_kernels.backend import get_backend
from pagedserve.models.loading.loader import LoadedModel

from ..config import EngineConfig
from . import Executor, WorkerFailedError
from .mp_executor import _INIT_TIMEOUT_S, comm_spec, make_comm
from .ray_placement import RankPlacement, actor_options, place_ranks, reserve_rank0_gpu
from ..worker.worker import ExecuteModelRequest, Worker

log = structlog.get_logger("pagedserve.engine")

RAY_MISSING = ("distributed_executor_backend='ray' needs Ray: pip install 'pagedserve[ray]' "
               "(or use the default local processes, 'mp')")


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError(RAY_MISSING) from None
    return ray


def ray_address(env: Any) -> str | None:
    """The cluster to join: RAY_ADDRESS, else None (Ray then starts a local one)."""
    address = env.get("RAY_ADDRESS") or None
    if address is not None and address.startswith("ray://"):
        raise ValueError(f"RAY_ADDRESS={address!r} is a Ray Client address, but the Ray executor's driver (rank 0) "
                         f"must run on a node of the cluster: give its GCS address (host:6379)")
    return address


def _rank_env() -> dict[str, str]:
    """What a rank must see as the driver does (PAGEDSERVE_BATCH_INVARIANT and the like): Ray starts actors
    with the raylet's environment, not the driver's."""
    return {k: v for k, v in os.environ.items() if k.startswith("PAGEDSERVE_")}


class _RayRank:
    """The body of one rank actor: a Worker plus its end of the collectives."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, spec: tuple) -> None:
        self.comm = make_comm(spec, rank, world_size)
        # Ray sets CUDA_VISIBLE_DEVICES to the actor's one GPU, so it is device 0 here.
        self.worker = Worker(config, rank, world_size, self.comm, local_device=0)

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

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
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=ray_address(os.environ), log_to_driver=False)
        n = config.tensor_parallel_size
        backend = get_backend(config.device)
        self.failure = None
        self.timeout_s = float(config.collective_timeout_s)
        self.pending: list[Any] = []
        self._last_poll = 0.0
        self.actors: list[Any] = []
        self.rank_pids: list[int] = []
        self.placement: RankPlacement | None = None
        self._holder = None
        self.comm = None
        try:
            self.placement = placement = place_ranks(ray, n, backend.is_gpu)
            self.rank_nodes = placement.rank_nodes
            local_device = 0
            if backend.is_gpu:
                self._holder, local_device = reserve_rank0_gpu(ray, placement, os.environ.get("CUDA_VISIBLE_DEVICES"))
            spec = comm_spec(config, backend.is_gpu)
            self.comm = make_comm(spec, 0, n, create=True, liveness=self.check_health)
            self.driver_worker = Worker(config, 0, n, self.comm, loaded, local_device=local_device)
            if spec[0] == "shm":
                spec = ("shm", self.comm.name, *spec[2:])
            rank_config = dataclasses.replace(config, model=str(self.driver_worker.model_path))
            rank_actor = ray.remote(_RayRank)
            self.actors = [rank_actor.options(**actor_options(placement, r, backend.is_gpu, _rank_env()))
                           .remote(rank_config, r, n, spec) for r in range(1, n)]
            try:
                where = ray.get([a.where.remote() for a in self.actors], timeout=_INIT_TIMEOUT_S)
            except ray.exceptions.RayError as e:  # a rank's __init__ raised, or its actor died loading
                raise WorkerFailedError(f"a tensor-parallel rank (Ray actor) failed to start: {e}") from e
            self.rank_pids = [pid for _, pid in where]
            if [node for node, _ in where] != self.rank_nodes[1:]:  # an actor outside its reserved bundle
                raise RuntimeError(f"Ray started the rank actors on {[node for node, _ in where]}, not on their "
                                   f"reserved nodes {self.rank_nodes[1:]}")
        except BaseException:
            self.shutdown()
            raise
        log.info("executor.started", backend="ray", tensor_parallel_size=n, collectives=spec[0],
                 driver_node=placement.driver_node, rank_nodes=self.rank_nodes, rank_pids=self.rank_pids,
                 nodes_used=len(set(self.rank_nodes)))

    def _call(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        if self.failure is not None:
            raise WorkerFailedError(f"the engine's ranks failed earlier: {self.failure}")
        ray = self.ray
        try:
            # By value, not ray.put: a step's batch is small, so Ray sends it inside each call, and an object in
            # the driver's node's store lost with that node would make Ray end the driver before it can fail cleanly.
            self.pending = [a.call.remote(method, *args) for a in self.actors]
            mine = getattr(self.driver_worker, method)(*args)
            theirs = ray.get(self.pending, timeout=timeout_s)
        except WorkerFailedError as e:
            raise self._fail(e) from e
        except Exception as e:  # noqa: BLE001 - ActorDiedError, RayTaskError, GetTimeoutError, CollectiveError
            raise self._fail(self._rank_error(e, method)) from e
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
                raise self._rank_error(e, "a collective", rank=self.pending.index(ref) + 1) from e

    def _rank_error(self, error: BaseException, during: str, rank: int | None = None) -> WorkerFailedError:
        """A WorkerFailedError naming the rank (its pid and node) where Ray's error says which one failed."""
        if rank is None:
            pid = re.search(r"\bpid: (\d+)", str(error))  # Ray's ActorDiedError names the actor's pid
            rank = self.rank_pids.index(int(pid[1])) + 1 if pid and int(pid[1]) in self.rank_pids else None
        if rank is None or rank > len(self.rank_pids):
            return WorkerFailedError(f"a tensor-parallel rank (Ray actor) failed during {during}: {error}")
        return WorkerFailedError(f"tensor-parallel rank {rank} (Ray actor, pid {self.rank_pids[rank - 1]}, node "
                                 f"{self.rank_nodes[rank][:12]}) failed during {during}: {error}")

    def _fail(self, error: WorkerFailedError) -> WorkerFailedError:
        if self.failure is None:
            self.comm.abort()
            self.failure = error
            log.error("executor.rank_failed", error=str(error))
        return self.failure

    def shutdown(self) -> None:
        """Kill the rank actors, release their placement group, and stop Ray if this executor started it."""
        for a in [*self.actors, *([self._holder] if self._holder is not None else [])]:
            try:
                self.ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors, self._holder = [], None
        if self.placement is not None:
            try:
                self.ray.util.remove_placement_group(self.placement.group)
            except Exception:  # noqa: BLE001 - its node is gone
                pass
            self.placement = None
        if self.comm is not None:
            self.comm.close()
            self.comm = None
        if self._owns_ray and self.ray.is_initialized():
            self.ray.shutdown()
