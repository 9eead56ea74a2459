"""MultiprocExecutor: tensor parallelism with ranks 1..N-1 as local processes (spawned, one per rank).

    driver process (rank 0)                     rank r process
    Worker(rank 0) loads its shard first        Worker(rank r) loads its shard (from disk: its slices)
    -- ("initialize_cache", ...) ------------>  replies ("ok", result) on its pipe
    -- pickled ExecuteModelRequest ---------->  execute_model (no reply: the collectives are the sync)
       execute_model <==== all-reduce / gather (shared memory on CPU, NCCL on GPU) ====>

Faults. Every wait is bounded: collectives by the communicator's deadline, and on the driver by a
liveness check of the rank processes (their exit sentinels) every few milliseconds of waiting; replies
by `collective_timeout_s` and the same check. A rank that raises aborts the group and reports its
traceback on its pipe; a rank whose driver is gone (pipe closed, parent changed) exits. After a failure
every call raises WorkerFailedError naming the rank, its pid and exit code. Ranks ignore SIGINT and
SIGTERM: the driver decides when they stop (systemd signals the whole control group on stop).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

import structlog

from pagedserve.cupy_kernels.collectives import (DEFAULT_SLOT_BYTES, CollectiveError, NcclCommunicator, ShmCommunicator,
                                                 nccl_unique_id)
from pagedserve.cupy_kernels.backend import get_backend
from pagedserve.models.loading.loader import LoadedModel

from ..config import EngineConfig
from . import Executor, WorkerFailedError
from ..worker.worker import ExecuteModelRequest, Worker

log = structlog.get_logger("pagedserve.engine")

_INIT_TIMEOUT_S = 600.0  # loading a shard and capturing graphs may take minutes on a big model


def local_device_count(backend: Any) -> int:
    return int(backend.xp.cuda.runtime.getDeviceCount()) if backend.is_gpu else 0


def comm_spec(config: EngineConfig, is_gpu: bool) -> tuple:
    """How ranks reach each other: ("nccl", unique id) on GPUs, ("shm", name, slot bytes, timeout) on CPU
    (name filled in once rank 0 created the segment; larger tensors go through a slot in chunks)."""
    if is_gpu:
        return ("nccl", nccl_unique_id())
    return ("shm", None, DEFAULT_SLOT_BYTES, float(config.collective_timeout_s))


def make_comm(spec: tuple, rank: int, world_size: int, create: bool = False, liveness=None, wake=None) -> Any:
    if spec[0] == "nccl":
        return NcclCommunicator(spec[1], rank, world_size)
    _, name, slot, timeout = spec
    return ShmCommunicator(name, rank, world_size, create=create, slot_bytes=slot, timeout_s=timeout,
                           liveness=liveness, wake=wake)


def check_world_size(config: EngineConfig, backend: Any, executor: str) -> None:
    """GPU ranks each need a device; local processes can only use this host's."""
    if backend.is_gpu and executor != "ray":
        count = local_device_count(backend)
        if config.tensor_parallel_size > count:
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} needs one GPU per rank but this "
                             f"host has {count}; lower it, or use distributed_executor_backend='ray' across hosts")


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        n = config.tensor_parallel_size
        backend = get_backend(config.device)
        check_world_size(config, backend, "mp")
        self.failure = None
        self.procs: list[mp.Process] = []
        self.conns: list[Connection] = []
        self.timeout_s = float(config.collective_timeout_s)
        # Rank 0 first: it validates the split (ValueError naming the numbers) and fills the GGUF conversion
        # cache once, which the other ranks then read their slices from.
        spec = comm_spec(config, backend.is_gpu)
        ctx = mp.get_context("spawn")  # never fork: the driver may hold threads, gRPC or a CUDA context
        wake = [ctx.Semaphore(0) for _ in range(n)] if spec[0] == "shm" else None  # see collectives.py
        self.comm = make_comm(spec, 0, n, create=True, liveness=self.check_health, wake=wake)
        try:
            self.driver_worker = Worker(config, 0, n, self.comm, loaded)
        except BaseException:
            self.comm.close()
            raise
        if spec[0] == "shm":
            spec = ("shm", self.comm.name, *spec[2:])
        rank_config = dataclasses.replace(config, model=str(self.driver_worker.model_path))
        for rank in range(1, n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(child, rank_config, rank, n, spec, wake, os.getpid()),
                            name=f"pagedserve-rank{rank}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop_ranks, self.procs, self.conns, self.comm)
        self._watchdog = None
        try:
            self._collect("ready", _INIT_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        if backend.is_gpu:  # NCCL's waits are unbounded: a thread turns a dead rank into ncclCommAbort
            self._watchdog = threading.Thread(target=self._watch, name="pagedserve-rank-watchdog", daemon=True)
            self._watchdog.start()
        log.info("executor.started", backend="mp", tensor_parallel_size=n,
                 rank_pids=[p.pid for p in self.procs], collectives=spec[0])

    # -- calls on every rank ---------------------------------------------------------------------

    def _broadcast(self, method: str, *args: Any) -> None:
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(payload)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        """Each rank's reply, in rank order; bounded by timeout_s and by the ranks' liveness."""
        results = []
        deadline = time.monotonic() + timeout_s
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll(0.05):
                self.check_health()
                if time.monotonic() > deadline:
                    raise WorkerFailedError(f"rank {rank} did not answer {what!r} within {timeout_s:g} s")
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                self.check_health(wait_s=2.0)
                raise WorkerFailedError(f"rank {rank} closed its pipe during {what!r}") from None
            if status != "ok":
                raise WorkerFailedError(f"rank {rank} failed during {what!r}:\n{value}")
            results.append(value)
        return results

    def _call(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        if self.failure is not None:
            raise WorkerFailedError(f"the engine's ranks failed earlier: {self.failure}")
        try:
            self._broadcast(method, *args)
            mine = getattr(self.driver_worker, method)(*args)
            return [mine, *self._collect(method, timeout_s)]
        except BaseException as e:
            # Any error mid-call leaves the ranks' collectives out of step: the group is finished.
            failure = self._fail(e)
            if isinstance(e, (CollectiveError, WorkerFailedError, OSError)):
                raise failure from e
            raise

    def determine_num_kv_blocks(self, max_model_len: int) -> int:
        return min(self._call("determine_num_kv_blocks", max_model_len, timeout_s=_INIT_TIMEOUT_S))

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self._call("initialize_cache", num_blocks, max_model_len, timeout_s=_INIT_TIMEOUT_S)

    def execute_model(self, request: ExecuteModelRequest) -> Any:
        if self.failure is not None:
            raise WorkerFailedError(f"the engine's ranks failed earlier: {self.failure}")
        try:
            self._broadcast("execute_model", request)
            return self.driver_worker.execute_model(request)
        except BaseException as e:
            # Any error mid-call leaves the ranks' collectives out of step: the group is finished.
            failure = self._fail(e)
            if isinstance(e, (CollectiveError, WorkerFailedError, OSError)):
                raise failure from e
            raise

    # -- faults ------------------------------------------------------------------------------------

    def check_health(self, wait_s: float = 0.0) -> None:
        """Raise WorkerFailedError naming the first rank process that has exited (waiting up to wait_s)."""
        if self.failure is not None:
            raise self.failure
        dead = wait([p.sentinel for p in self.procs], timeout=wait_s) if self.procs else []
        if dead:
            p = next(p for p in self.procs if p.sentinel in dead)
            rank = self.procs.index(p) + 1
            p.join(1.0)
            raise WorkerFailedError(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}")

    def _fail(self, error: BaseException) -> WorkerFailedError:
        """Record the first failure (preferring the dead rank's own words), abort the group, return it."""
        if self.failure is not None:
            return self.failure
        self.comm.abort()
        failure = error if isinstance(error, WorkerFailedError) else None
        try:
            self.check_health(wait_s=1.0)  # a rank that died is usually why the collective failed
        except WorkerFailedError as e:
            failure = e
        for rank, conn in enumerate(self.conns, start=1):  # a rank that raised said why before exiting
            try:
                if conn.poll(0.2):
                    status, value = conn.recv()
                    if status == "error":
                        failure = WorkerFailedError(f"tensor-parallel rank {rank} failed:\n{value}")
                        break
            except (EOFError, OSError):
                pass
        self.failure = failure or WorkerFailedError(f"tensor-parallel step failed: {error}")
        log.error("executor.rank_failed", error=str(self.failure))
        return self.failure

    def _watch(self) -> None:
        while self.procs and self._finalizer.alive:
            try:
                self.check_health(wait_s=0.5)
            except WorkerFailedError as e:
                self._fail(e)
                return

    def shutdown(self) -> None:
        self._finalizer()


def _stop_ranks(procs: list[mp.Process], conns: list[Connection], comm: Any) -> None:
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("shutdown", ())))
        except OSError:
            pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5.0)
    for conn in conns:
        conn.close()
    comm.close()


def _rank_main(conn: Connection, config: EngineConfig, rank: int, world_size: int, spec: tuple, wake: Any,
               parent_pid: int) -> None:
    """A rank process: load the shard, then run what the driver sends until it says stop or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def driver_alive() -> None:
        if os.getppid() != parent_pid:
            raise CollectiveError(f"rank {rank}: the driver process {parent_pid} is gone")

    comm = None
    local_device = None
    if spec[0] == "nccl":  # before CuPy loads: this process sees only its own GPU, as device 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[rank] if visible else str(rank)
        local_device = 0
    try:
        comm = make_comm(spec, rank, world_size, liveness=driver_alive, wake=wake)
        worker = Worker(config, rank, world_size, comm, local_device=local_device)
        conn.send(("ok", None))
        while True:
            try:
                method, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break  # the driver closed the pipe or died
            if method == "shutdown":
                break
            result = getattr(worker, method)(*args)
            if method != "execute_model":
                conn.send(("ok", result))
    except BaseException:  # noqa: BLE001 - report, abort the group, exit non-zero
        if comm is not None:
            comm.abort()
        try:
            conn.send(("error", traceback.format_exc(limit=12)))
        except OSError:
            pass
        os._exit(1)
    finally:
        if comm is not None:
            comm.close()
