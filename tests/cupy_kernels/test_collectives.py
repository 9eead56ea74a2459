"""The shared-memory collectives among real processes, against numpy; bounded waits on failure."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from pagedserve.cupy_kernels.collectives import CollectiveError, ShmCommunicator, SingleRank


def _inputs(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    # Shapes below and above the slot size (64 floats here), so chunking is exercised.
    return [rng.standard_normal(s).astype(np.float32) for s in [(3, 5), (7, 40), (1,), (2, 300)]]


def _rank_main(name: str, rank: int, world: int, slot_bytes: int, out: mp.Queue, wake) -> None:
    comm = ShmCommunicator(name, rank, world, slot_bytes=slot_bytes, timeout_s=30.0, wake=wake)
    results = []
    for _ in range(3):  # repeated ops cycle through both buffer sets
        for x in _inputs(rank):
            results.append(("reduce", comm.all_reduce(x)))
            results.append(("gather", comm.gather(x)))
    out.put((rank, results))
    comm.close()


@pytest.mark.parametrize("world, wake", [(2, True), (3, True), (2, False)])
def test_all_reduce_and_gather_among_processes_match_numpy(world, wake):
    ctx = mp.get_context("spawn")
    slot_bytes = 64 * 4
    sems = [ctx.Semaphore(0) for _ in range(world)] if wake else None  # sleep on semaphores, or poll
    root = ShmCommunicator(None, 0, world, create=True, slot_bytes=slot_bytes, timeout_s=30.0, wake=sems)
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(root.name, r, world, slot_bytes, q, sems)) for r in range(1, world)]
    for p in procs:
        p.start()
    try:
        mine = []
        for _ in range(3):
            for x in _inputs(0):
                mine.append(("reduce", root.all_reduce(x)))
                mine.append(("gather", root.gather(x)))
        others = dict(q.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
        root.close()
    ins = [_inputs(r) for r in range(world)]
    expected = []
    for _ in range(3):
        for i in range(len(ins[0])):
            total = ins[0][i].copy()
            for r in range(1, world):
                total += ins[r][i]  # rank order, as the communicator sums
            expected.append(total)
            expected.append(np.concatenate([ins[r][i] for r in range(world)], axis=-1))
    for (kind, got), want in zip(mine, expected):
        np.testing.assert_array_equal(got, want)  # same order of float32 additions: exact
    for rank in range(1, world):
        for (kind, got), (_, mine_got) in zip(others[rank], mine):
            if kind == "reduce":
                np.testing.assert_array_equal(got, mine_got)  # every rank holds the same bits
            else:
                assert got is None


def test_world_of_one_is_the_identity():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert SingleRank().all_reduce(x) is x and SingleRank().gather(x) is x


def test_a_rank_that_never_arrives_fails_the_wait_at_its_deadline():
    comm = ShmCommunicator(None, 0, 2, create=True, slot_bytes=256, timeout_s=0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(CollectiveError, match=r"ranks \[1\] did not reach collective op 0 within 0.3 s"):
            comm.all_reduce(np.ones(4, np.float32))
        assert time.monotonic() - t0 < 10.0
    finally:
        comm.close()


def test_liveness_and_abort_end_a_wait_at_once():
    comm = ShmCommunicator(None, 0, 2, create=True, slot_bytes=256, timeout_s=600.0)
    peer = ShmCommunicator(comm.name, 1, 2, slot_bytes=256, timeout_s=600.0)
    try:
        def dead():
            raise CollectiveError("rank 1 (pid 123) exited with code -9")

        comm.liveness = dead
        with pytest.raises(CollectiveError, match="exited with code -9"):
            comm.all_reduce(np.ones(4, np.float32))
        comm.abort()
        with pytest.raises(CollectiveError, match="aborted"):
            peer.all_reduce(np.ones(4, np.float32))  # the group is broken: no further op starts
    finally:
        peer.close()
        comm.close()
