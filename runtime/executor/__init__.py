"""Executor: the engine's one handle on its workers, whatever their number and wherever they run.

- `UniProcExecutor` (tensor_parallel_size 1): the single Worker, in this process.
- `MultiprocExecutor` (mp_executor.py): rank 0 in this process (the driver worker, whose logits feed
  the sampler), ranks 1..N-1 as local processes; each step's batch is pickled once and sent to each.
- `RayExecutor` (ray_executor.py): ranks 1..N-1 as Ray actors, for ranks on several hosts.

The scheduler runs once, in the driver; ranks only execute. A rank that dies makes every later call
raise WorkerFailedError (the engine is then unusable and the server exits non-zero).
"""

from __future__ import annotations

from typing import Any

from pagedserve.models.loading.loader import LoadedModel

from ..config import EngineConfig
from ..worker.worker import ExecuteModelRequest, Worker


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank died or failed: in-flight requests cannot complete, the engine is done."""


class Executor:
    driver_worker: Worker
    failure: BaseException | None = None

    @property
    def world_size(self) -> int:
        return self.driver_worker.world_size

    def determine_num_kv_blocks(self, max_model_len: int) -> int:
        return self.driver_worker.determine_num_kv_blocks(max_model_len)

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.driver_worker.initialize_cache(num_blocks, max_model_len)

    def execute_model(self, request: ExecuteModelRequest) -> Any:
        return self.driver_worker.execute_model(request)

    def check_health(self) -> None:
        """Raise WorkerFailedError if a rank has died."""

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.driver_worker = Worker(config, loaded=loaded)


def make_executor(config: EngineConfig, loaded: LoadedModel | None = None) -> Executor:
    if config.tensor_parallel_size == 1:
        return UniProcExecutor(config, loaded)
    if (config.distributed_executor_backend or "mp") == "ray":
        from .ray_executor import RayExecutor

        return RayExecutor(config, loaded)
    from .mp_executor import MultiprocExecutor

    return MultiprocExecutor(config, loaded)
