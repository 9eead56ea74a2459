"""Tests for the block pool: counts, ref counts, free-queue order, double frees, integrity."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.runtime.core.block_pool import BlockPool, BlockPoolIntegrityError, FreeKVBlockQueue, KVBlock, NoFreeBlocksError  # noqa: E501


def test_fresh_pool_is_all_free_in_id_order() -> None:
    pool = BlockPool(num_blocks=5, block_size=16)
    assert (pool.num_blocks, pool.block_size) == (5, 16)
    assert (pool.num_free_blocks, pool.num_used_blocks) == (5, 0)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4]
    assert all(pool.ref_cnt(i) == 0 for i in range(5))
    pool.check_integrity([])


@pytest.mark.parametrize(
    ("num_blocks", "block_size"), [(0, 4), (-1, 4), (4, 0), (4, -2), (2.0, 4), (4, True)]
)
def test_constructor_rejects_bad_sizes(num_blocks: object, block_size: object) -> None:
    with pytest.raises(ValueError, match="num_blocks|block_size"):
        BlockPool(num_blocks, block_size)  # type: ignore[arg-type]


def test_allocate_takes_from_the_head_with_ref_cnt_one() -> None:
    pool = BlockPool(6, 4)
    assert pool.allocate(0) == []
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.ref_cnt(i) for i in range(6)] == [1, 1, 1, 0, 0, 0]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (3, 3)
    assert pool.free_block_ids() == [3, 4, 5]
    pool.check_integrity([[0, 1], [2]])


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4, 4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError, match="cannot allocate 2 blocks: only 1 of 4"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert pool.free_block_ids() == [3]
    pool.check_integrity([[0, 1, 2]])


@pytest.mark.parametrize("n", [-1, 1.5, None])
def test_allocate_rejects_bad_counts(n: object) -> None:
    with pytest.raises(ValueError, match="non-negative int"):
        BlockPool(4, 4).allocate(n)  # type: ignore[arg-type]


def test_free_appends_to_tail_in_the_given_order() -> None:
    pool = BlockPool(5, 4)
    pool.allocate(4)  # [0, 1, 2, 3]; free queue [4]
    pool.free([2, 0])
    assert pool.free_block_ids() == [4, 2, 0]
    # Least recently freed first: 4 was never used, then 2, then 0.
    assert pool.allocate(2) == [4, 2]
    assert pool.free_block_ids() == [0]
    pool.check_integrity([[1, 3], [4, 2]])


def test_incref_and_free_count_references() -> None:
    pool = BlockPool(3, 4)
    [b] = pool.allocate(1)
    pool.incref([b])
    pool.incref([b])
    assert pool.ref_cnt(b) == 3
    pool.check_integrity([[b], [b], [b]])
    pool.free([b])
    assert pool.ref_cnt(b) == 2 and pool.num_used_blocks == 1
    pool.free([b, b])  # several references of one block in one call
    assert pool.ref_cnt(b) == 0 and pool.num_used_blocks == 0
    assert pool.free_block_ids() == [1, 2, 0]


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3, 4)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(ValueError, match=f"double free of block {a}"):
        pool.free([b, a])
    # b was listed before the bad id and still was not freed: the call is all-or-nothing.
    assert pool.ref_cnt(b) == 1
    with pytest.raises(ValueError, match=f"double free of block {b}: freeing 2"):
        pool.free([b, b])
    assert pool.ref_cnt(b) == 1
    assert pool.free_block_ids() == [2, a]
    pool.check_integrity([[b]])


def test_incref_of_a_free_block_raises_and_changes_nothing() -> None:
    pool = BlockPool(3, 4)
    [a] = pool.allocate(1)
    with pytest.raises(ValueError, match="cannot incref block 1: it is free"):
        pool.incref([a, 1])
    assert pool.ref_cnt(a) == 1
    pool.check_integrity([[a]])


@pytest.mark.parametrize("bad", [-1, 3, 100, "0", 1.0, True])
def test_block_ids_are_validated(bad: object) -> None:
    pool = BlockPool(3, 4)
    pool.allocate(3)
    for call in (lambda: pool.ref_cnt(bad), lambda: pool.free([bad]), lambda: pool.incref([bad])):
        with pytest.raises(ValueError, match="block id"):
            call()  # type: ignore[arg-type]
    assert [pool.ref_cnt(i) for i in range(3)] == [1, 1, 1]


def test_integrity_error_is_an_assertion_error() -> None:
    assert issubclass(BlockPoolIntegrityError, AssertionError)


@pytest.mark.parametrize(
    ("tables", "message"),
    [
        ([[0]], "block 1 has ref_cnt 1 but appears 0"),  # a reference lost
        ([[0, 1], [1]], "block 1 has ref_cnt 1 but appears 2"),  # a reference invented
        ([[0, 1, 2]], "block 2 has ref_cnt 0 but appears 1"),  # a free block in a table
        ([[0, 1, 7]], "not a block id"),
    ],
)
def test_check_integrity_catches_table_mismatches(
    tables: list[list[int]], message: str
) -> None:
    pool = BlockPool(4, 4)
    pool.allocate(2)
    pool.check_integrity([[0, 1]])
    with pytest.raises(BlockPoolIntegrityError, match=message):
        pool.check_integrity(tables)


def test_check_integrity_catches_a_corrupted_free_queue() -> None:
    pool = BlockPool(4, 4)
    pool.allocate(1)
    # A used block that also sits in the free queue.
    pool._free_queue.append(pool._blocks[0])
    with pytest.raises(BlockPoolIntegrityError, match="used block 0"):
        pool.check_integrity([[0]])

    pool = BlockPool(4, 4)
    # A free block dropped from the queue: lost.
    pool._free_queue.remove(pool._blocks[2])
    with pytest.raises(BlockPoolIntegrityError, match="free block 2 is in the free queue 0"):
        pool.check_integrity([])

    pool = BlockPool(4, 4)
    # A cycle: 3 links back to 1.
    pool._blocks[3].next_free = pool._blocks[1]
    with pytest.raises(BlockPoolIntegrityError, match="back link|cycle"):
        pool.check_integrity([])

    pool = BlockPool(4, 4)
    pool._free_queue._len = 3
    with pytest.raises(BlockPoolIntegrityError, match="length counter"):
        pool.check_integrity([])


def test_check_integrity_still_raises_under_python_O() -> None:
    # The check must not rely on `assert` statements, which -O strips.
    code = (
        "from pagedserve.runtime.core.block_pool import BlockPool, BlockPoolIntegrityError\n"
        "pool = BlockPool(4, 4); pool.allocate(2)\n"
        "try:\n"
        "    pool.check_integrity([[0]])\n"
        "except BlockPoolIntegrityError:\n"
        "    print('raised')\n"
    )
    out = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "raised"


def test_free_queue_remove_from_the_middle() -> None:
    blocks = [KVBlock(block_id=i) for i in range(5)]
    queue = FreeKVBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4] and len(queue) == 4
    assert not blocks[2].is_in_free_queue and blocks[3].is_in_free_queue
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert queue.block_ids() == [1, 3]
    assert queue.popleft() is blocks[1]
    queue.append(blocks[2])
    assert queue.block_ids() == [3, 2]
    assert [b.block_id for b in queue.check_links(max_len=5)] == [3, 2]
    queue.popleft()
    queue.popleft()
    assert len(queue) == 0 and queue.block_ids() == []
    with pytest.raises(NoFreeBlocksError):
        queue.popleft()


_QUEUE_OPS = st.lists(
    st.tuples(st.sampled_from(["append", "popleft", "remove"]), st.integers(0, 7)), max_size=40
)


@settings(max_examples=150, deadline=None)
@given(ops=_QUEUE_OPS)
def test_free_queue_matches_a_list_model(ops: list[tuple[str, int]]) -> None:
    blocks = [KVBlock(block_id=i) for i in range(8)]
    queue = FreeKVBlockQueue(blocks[:4])
    model = [0, 1, 2, 3]
    for op, i in ops:
        if op == "append" and i not in model:
            queue.append(blocks[i])
            model.append(i)
        elif op == "popleft" and model:
            assert queue.popleft().block_id == model.pop(0)
        elif op == "remove" and i in model:
            queue.remove(blocks[i])  # often from the middle
            model.remove(i)
        assert queue.block_ids() == model
        assert len(queue) == len(model)
        assert [b.block_id for b in queue.check_links(max_len=8)] == model
        assert [b.is_in_free_queue for b in blocks] == [j in model for j in range(8)]


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / incref / free against a model of ref counts and free-queue order."""

    @initialize(num_blocks=st.integers(1, 10))
    def init(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, block_size=2)
        self.held: list[int] = []  # one entry per reference the "callers" hold
        self.free_order = list(range(num_blocks))  # model of the free queue, head first

    @rule(n=st.integers(0, 4))
    def allocate(self, n: int) -> None:
        if n > len(self.free_order):
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return
        got = self.pool.allocate(n)
        assert got == self.free_order[:n]
        del self.free_order[:n]
        self.held.extend(got)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(set(self.held))), max_size=3))
        self.pool.incref(ids)
        self.held.extend(ids)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        picks = data.draw(
            st.lists(st.integers(0, len(self.held) - 1), min_size=1, max_size=4, unique=True)
        )
        ids = [self.held[i] for i in picks]
        self.pool.free(ids)
        for i in sorted(picks, reverse=True):
            del self.held[i]
        remaining = Counter(self.held) + Counter(ids)
        for block_id in ids:  # a block joins the queue when its last reference goes
            remaining[block_id] -= 1
            if remaining[block_id] == 0:
                self.free_order.append(block_id)

    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        block_id = data.draw(st.integers(0, self.pool.num_blocks - 1))
        too_many = self.held.count(block_id) + 1
        with pytest.raises(ValueError, match="double free"):
            self.pool.free([block_id] * too_many)

    @precondition(lambda self: self.free_order)
    @rule()
    def incref_free_block(self) -> None:
        with pytest.raises(ValueError, match="is free"):
            self.pool.incref([self.free_order[-1]])

    @invariant()
    def matches_model(self) -> None:
        counts = Counter(self.held)
        assert [self.pool.ref_cnt(i) for i in range(self.pool.num_blocks)] == [
            counts[i] for i in range(self.pool.num_blocks)
        ]
        assert self.pool.free_block_ids() == self.free_order
        assert self.pool.num_free_blocks == len(self.free_order)
        assert self.pool.num_used_blocks == len(counts)
        self.pool.check_integrity([self.held])

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.free(self.held)
        assert self.pool.num_used_blocks == 0
        assert self.pool.num_free_blocks == self.pool.num_blocks
        self.pool.check_integrity([])


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
