"""Collectives for tensor parallelism: sum all-reduce and gather-to-one among the ranks of one model.

Three communicators share one small interface (`rank`, `world_size`, `all_reduce`, `gather`, `close`):

- `SingleRank`: world size 1, every op is the identity (TP=1 runs the same model code).
- `ShmCommunicator`: CPU ranks on one host (local processes, or Ray actors on one node), through one
  `multiprocessing.shared_memory` segment, as vLLM's CPU backend does across sockets.
- `NcclCommunicator`: CUDA ranks through `cupy.cuda.nccl` (one GPU per rank).

The shared-memory protocol (one barrier per op, no locks):

    segment = header | data
    header  : per rank one 64-byte line holding its arrival counter (only that rank writes it),
              per rank one line saying which op it sleeps on (0 = awake), one line with the abort
              flag (anyone may set it)
    data    : 2 sets x world_size slots x slot_elems float32

    op number k (every rank runs the same sequence of ops, so k agrees across ranks):
      1. write my tensor into data[k % 2][rank]
      2. arrive[rank] = k + 1
      3. wait until arrive[r] >= k + 1 for every r      (bounded: deadline, abort flag, liveness)
      4. read the slots I need (all of them for all_reduce, all on dst for gather)

Why two sets are enough: a rank writes set k % 2 again at op k + 2 only after passing op k + 1's
barrier, and every other rank arrives at op k + 1 only after it finished reading op k. Stores become
visible in program order on x86-64 (TSO), so data written before the counter is seen with it; a
weakly ordered CPU would need a fence here. Every rank sums the slots in rank order, so all ranks hold
bitwise the same result (their residual streams never drift apart). Tensors larger than a slot go
through in chunks, one op per chunk.

Waiting: a short spin (a peer on another core arrives within microseconds), then, when the ranks share
per-rank semaphores (`wake`, local processes), sleep on one's own semaphore in 2 ms slices: a rank that
arrives posts the semaphore of every rank that said it sleeps on this op. On a host with more busy
processes than cores this lets the late rank have the core at once instead of fighting spinners. A
wake-up lost to the race between "I sleep" and "I arrived" costs at most one 2 ms slice. Without
semaphores (Ray actors) the wait backs off to 50 us sleeps.

Every wait is bounded: it fails with CollectiveError at `timeout_s`, at once when another rank set the
abort flag, and, when the owner gave a `liveness` callback (the driver checks its rank processes), as
soon as that callback raises.
"""

from __future__ import annotations

import time
from multiprocessing import shared_memory
from typing import Any, Callable, Sequence

import numpy as np

_LINE = 64  # bytes: one cache line per counter, so ranks spinning on counters do not share lines
DEFAULT_SLOT_BYTES = 8 << 20  # per rank and set; 2 x world_size of them in the segment


class CollectiveError(RuntimeError):
    """A collective did not complete: a rank died, another rank aborted, or the wait timed out."""


class SingleRank:
    """World size 1: nothing to exchange."""

    rank = 0
    world_size = 1

    def all_reduce(self, x: Any) -> Any:
        return x

    def gather(self, x: Any, axis: int = -1) -> Any:
        return x

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


class ShmCommunicator:
    """All-reduce (sum) and gather among local CPU processes through one shared-memory segment.

    Rank 0 creates the segment (`create=True`) and must outlive the others' use of it; the other
    ranks attach by `name`. float32 only (the CPU backend's dtype).
    """

    def __init__(self, name: str | None, rank: int, world_size: int, create: bool = False,
                 slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float = 60.0,
                 liveness: Callable[[], None] | None = None, wake: Sequence[Any] | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.rank, self.world_size = rank, world_size
        self.timeout_s = timeout_s
        self.liveness = liveness
        self.slot_elems = max(1, slot_bytes // 4)
        if wake is not None and len(wake) != world_size:
            raise ValueError(f"wake needs one semaphore per rank ({world_size}), got {len(wake)}")
        self.wake = wake
        header = (2 * world_size + 1) * _LINE
        size = header + 2 * world_size * self.slot_elems * 4
        if create:
            self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        else:
            self.shm = _attach(name)
            if self.shm.size < size:
                raise ValueError(f"shared memory {name!r} holds {self.shm.size} bytes, expected {size}")
        self.name = self.shm.name
        self._owner = create
        buf = self.shm.buf
        lines = np.ndarray((2 * world_size + 1, _LINE // 8), dtype=np.int64, buffer=buf)
        counters = lines.reshape(-1)
        self._arrive = lines[:world_size, 0]  # one int64 per line
        self._sleeping = lines[world_size : 2 * world_size, 0]
        self._abort = lines[2 * world_size, :1]
        if create:
            counters[:] = 0
        self._data = np.ndarray((2, world_size, self.slot_elems), dtype=np.float32, buffer=buf, offset=header)
        self._op = int(self._arrive[rank])  # a fresh segment: 0

    # -- the ops ------------------------------------------------------------------------------

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """Sum of x over the ranks, in rank order (the same bits on every rank); returns a new array."""
        flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        out = np.empty_like(flat)
        for start in range(0, flat.size, self.slot_elems):
            part = flat[start : start + self.slot_elems]
            slots = self._exchange(part)
            acc = out[start : start + part.size]
            np.copyto(acc, slots[0, : part.size])
            for r in range(1, self.world_size):
                acc += slots[r, : part.size]
        return out.reshape(x.shape)

    def gather(self, x: np.ndarray, axis: int = -1) -> np.ndarray | None:
        """Rank 0 gets every rank's x concatenated along `axis` (same shapes on every rank); others None."""
        flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        parts = [np.empty_like(flat) for _ in range(self.world_size)] if self.rank == 0 else None
        for start in range(0, flat.size, self.slot_elems):
            part = flat[start : start + self.slot_elems]
            slots = self._exchange(part)
            if parts is not None:
                for r in range(self.world_size):
                    parts[r][start : start + part.size] = slots[r, : part.size]
        if parts is None:
            return None
        return np.concatenate([p.reshape(x.shape) for p in parts], axis=axis)

    def _exchange(self, part: np.ndarray) -> np.ndarray:
        """Steps 1-3 of the protocol; returns the op's set of slots (valid until op + 2)."""
        if self._abort[0]:
            raise CollectiveError(f"rank {self.rank}: the group was aborted (a rank failed); no more collectives")
        k = self._op
        self._op += 1
        slots = self._data[k % 2]
        slots[self.rank, : part.size] = part
        self._arrive[self.rank] = k + 1
        if self.wake is not None:
            sleeping = self._sleeping
            for r in range(self.world_size):
                if r != self.rank and 0 < sleeping[r] <= k + 1:
                    self.wake[r].release()
        self._wait_all(k + 1)
        return slots

    def _wait_all(self, target: int) -> None:
        arrive = self._arrive
        for _ in range(200):  # spin: a peer running on another core arrives within microseconds
            if arrive.min() >= target:
                return
        deadline = time.monotonic() + self.timeout_s
        next_check = 0.0
        while arrive.min() < target:
            if self._abort[0]:
                raise CollectiveError(f"rank {self.rank}: collective aborted by another rank")
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.002
                if self.liveness is not None:
                    self.liveness()
                if now > deadline:
                    late = [r for r in range(self.world_size) if arrive[r] < target]
                    raise CollectiveError(f"rank {self.rank}: ranks {late} did not reach collective op "
                                          f"{target - 1} within {self.timeout_s:g} s")
            if self.wake is None:
                time.sleep(50e-6)
                continue
            self._sleeping[self.rank] = target
            if arrive.min() < target:  # checked again after saying so, so a rank arriving now wakes us
                self.wake[self.rank].acquire(timeout=0.002)
            self._sleeping[self.rank] = 0

    def abort(self) -> None:
        """Make every rank's current and next wait fail at once (a rank died or a step failed)."""
        try:
            self._abort[0] = 1
        except (TypeError, ValueError):
            pass  # already closed

    def close(self) -> None:
        self._arrive = self._sleeping = self._abort = self._data = None  # drop views before closing the buffer
        try:
            self.shm.close()
        except BufferError:
            pass
        if self._owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def _attach(name: str) -> shared_memory.SharedMemory:
    """Attach to the creator's segment. Where Python allows it (3.13+), without registering it with this
    process's resource tracker: the creator owns and unlinks it. (Before 3.13 the registration is
    harmless for spawned ranks, which share the creator's tracker, and a set holds the name once.)"""
    try:
        return shared_memory.SharedMemory(name=name, track=False)
    except TypeError:
        return shared_memory.SharedMemory(name=name)


class NcclCommunicator:
    """CUDA ranks through NCCL (cupy.cuda.nccl); one process and one GPU per rank.

    Rank 0 makes the id with `nccl_unique_id()` and the executor hands it to every rank. Joining the
    group (ncclCommInitRank) blocks until every rank joins, so it happens at the first collective, which
    all ranks reach together (the first step or the KV-sizing profile), on the device the rank uses by
    then. NCCL's own waits are not bounded, so a dead peer is caught by the executor's liveness checks and
    turned into `abort()`, which aborts the communicator (ncclCommAbort) and so frees a rank blocked inside
    NCCL.
    """

    def __init__(self, unique_id: tuple, rank: int, world_size: int) -> None:
        from cupy.cuda import nccl  # imported here: the CPU path never needs CuPy

        self._nccl = nccl
        self.rank, self.world_size = rank, world_size
        self._unique_id = unique_id
        self._comm = None

    @property
    def comm(self) -> Any:
        if self._comm is None:
            self._comm = self._nccl.NcclCommunicator(self.world_size, self._unique_id, self.rank)
        return self._comm

    def _dtype(self, x: Any) -> int:
        nccl = self._nccl
        table = {np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32}
        try:
            return table[np.dtype(x.dtype)]
        except KeyError:
            raise ValueError(f"NCCL collectives take float16 or float32, got {x.dtype}") from None

    def all_reduce(self, x: Any) -> Any:
        import cupy as cp

        x = cp.ascontiguousarray(x)
        out = cp.empty_like(x)
        stream = cp.cuda.get_current_stream().ptr
        self.comm.allReduce(x.data.ptr, out.data.ptr, x.size, self._dtype(x), self._nccl.NCCL_SUM, stream)
        return out

    def gather(self, x: Any, axis: int = -1) -> Any:
        import cupy as cp

        x = cp.ascontiguousarray(x)
        out = cp.empty((self.world_size, *x.shape), dtype=x.dtype)
        stream = cp.cuda.get_current_stream().ptr
        self.comm.allGather(x.data.ptr, out.data.ptr, x.size, self._dtype(x), stream)
        if self.rank != 0:
            return None
        return cp.concatenate(list(out), axis=axis)

    def abort(self) -> None:
        try:
            if self._comm is not None:
                self._comm.abort()
        except Exception:  # noqa: BLE001 - already aborted or destroyed
            pass

    def close(self) -> None:
        try:
            if self._comm is not None:
                self._comm.destroy()
        except Exception:  # noqa: BLE001
            pass


def nccl_unique_id() -> tuple:
    from cupy.cuda import nccl

    return nccl.get_unique_id()
