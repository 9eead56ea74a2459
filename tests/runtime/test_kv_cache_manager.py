"""Tests for the KV cache manager: block tables, fork, copy-on-write, all-or-nothing, integrity.

The stateful test simulates the device KV cache (one token value per slot), applies the pending
copies the way the model runner would, and checks that every sequence reads back exactly its own
tokens through its block table, which is what copy-on-write is for.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.runtime.core.block_pool import BlockPoolIntegrityError
from pagedserve.runtime.core.kv_cache_manager import KVCacheManager, KVCacheUsage


def _refs(mgr: KVCacheManager) -> list[int]:
    return [mgr.pool.ref_cnt(i) for i in range(mgr.pool.num_blocks)]


def _snapshot(mgr: KVCacheManager, seq_ids: list[str]) -> tuple:
    return (
        {s: mgr.block_table(s) for s in seq_ids},
        [s in mgr for s in seq_ids],
        _refs(mgr),
        mgr.pool.free_block_ids(),
        list(mgr._pending_copies),  # read-only peek; take_pending_copies would clear it
    )


def test_unknown_sequence_has_an_empty_table_and_tables_are_copies() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    assert mgr.block_table("nope") == []
    assert "nope" not in mgr
    assert mgr.allocate_slots("a", 0, 5)
    table = mgr.block_table("a")
    table.append(99)
    assert mgr.block_table("a") == [0, 1]


def test_allocate_slots_grows_the_table_block_by_block() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    assert (mgr.block_size, mgr.num_free_blocks) == (4, 8)
    assert mgr.num_blocks_needed("a", 0, 5) == 2
    assert mgr.allocate_slots("a", 0, 5)  # prefill 5 tokens: positions 0..4
    assert mgr.block_table("a") == [0, 1]
    assert mgr.num_blocks_needed("a", 5, 3) == 0
    assert mgr.allocate_slots("a", 5, 3)  # positions 5..7 fit in block 1
    assert mgr.block_table("a") == [0, 1]
    assert mgr.num_blocks_needed("a", 8, 1) == 1
    assert mgr.allocate_slots("a", 8, 1)  # position 8 starts block 2
    assert mgr.block_table("a") == [0, 1, 2]
    assert mgr.num_free_blocks == 5
    assert mgr.take_pending_copies() == []
    mgr.check_integrity()


def test_zero_new_tokens_registers_the_sequence_without_blocks() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    assert mgr.allocate_slots("a", 0, 0)
    assert "a" in mgr and mgr.block_table("a") == []
    assert mgr.num_free_blocks == 4
    mgr.check_integrity()


def test_a_table_that_already_covers_the_range_is_left_alone() -> None:
    # E.g. after speculative tokens were rejected: num_computed_tokens went back.
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    assert mgr.allocate_slots("a", 0, 12)
    assert mgr.num_blocks_needed("a", 5, 2) == 0
    assert mgr.allocate_slots("a", 5, 2)
    assert mgr.block_table("a") == [0, 1, 2]
    assert mgr.num_free_blocks == 3


@pytest.mark.parametrize(
    ("seq_id", "computed", "new", "message"),
    [
        ("a", -1, 1, "num_computed_tokens must be a non-negative int"),
        ("a", 0, -1, "num_new_tokens must be a non-negative int"),
        ("a", 1.0, 1, "num_computed_tokens"),
        ("a", 0, None, "num_new_tokens"),
        ("a", 9, 1, "num_computed_tokens=9 exceeds the 8 token slots"),
        ("b", 1, 1, "num_computed_tokens=1 exceeds the 0 token slots"),
        (7, 0, 1, "seq_id must be a str"),
    ],
)
def test_invalid_arguments_raise_value_error(
    seq_id: object, computed: object, new: object, message: str
) -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    assert mgr.allocate_slots("a", 0, 8)
    before = _snapshot(mgr, ["a", "b"])
    for call in (mgr.allocate_slots, mgr.num_blocks_needed):
        with pytest.raises(ValueError, match=message):
            call(seq_id, computed, new)  # type: ignore[arg-type]
    assert _snapshot(mgr, ["a", "b"]) == before


def test_fork_shares_blocks_without_copying() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    assert mgr.allocate_slots("p", 0, 6)
    free_before = mgr.num_free_blocks
    mgr.fork("p", "c")
    assert mgr.block_table("c") == mgr.block_table("p") == [0, 1]
    assert _refs(mgr)[:2] == [2, 2]
    assert mgr.num_free_blocks == free_before
    assert mgr.take_pending_copies() == []
    mgr.check_integrity()


def test_fork_errors() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    assert mgr.allocate_slots("p", 0, 6)
    assert mgr.allocate_slots("q", 0, 1)
    with pytest.raises(ValueError, match="unknown parent sequence 'x'"):
        mgr.fork("x", "c")
    with pytest.raises(ValueError, match="child sequence 'q' already has a block table"):
        mgr.fork("p", "q")
    with pytest.raises(ValueError, match="already has a block table"):
        mgr.fork("p", "p")
    with pytest.raises(ValueError, match="seq_id must be a str"):
        mgr.fork("p", 3)  # type: ignore[arg-type]
    assert _refs(mgr)[:3] == [1, 1, 1]
    mgr.check_integrity()


def test_append_into_a_shared_partial_block_copies_exactly_that_block() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    assert mgr.allocate_slots("p", 0, 6)  # [0, 1]; block 1 holds positions 4..5
    mgr.fork("p", "c")
    assert mgr.num_blocks_needed("c", 6, 1) == 1
    assert mgr.allocate_slots("c", 6, 1)
    assert mgr.block_table("c") == [0, 2]
    assert mgr.block_table("p") == [0, 1]
    assert _refs(mgr)[:3] == [2, 1, 1]
    assert mgr.take_pending_copies() == [(1, 2)]
    assert mgr.take_pending_copies() == []  # taking clears
    # The parent is now the only holder of block 1 and writes into it in place.
    assert mgr.num_blocks_needed("p", 6, 1) == 0
    assert mgr.allocate_slots("p", 6, 1)
    assert mgr.block_table("p") == [0, 1]
    assert mgr.take_pending_copies() == []
    mgr.check_integrity()


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    assert mgr.allocate_slots("p", 0, 8)  # [0, 1], both full
    mgr.fork("p", "c")
    assert mgr.num_blocks_needed("c", 8, 1) == 1
    assert mgr.allocate_slots("c", 8, 1)
    assert mgr.allocate_slots("p", 8, 1)
    assert mgr.block_table("c") == [0, 1, 2]
    assert mgr.block_table("p") == [0, 1, 3]
    assert _refs(mgr)[:4] == [2, 2, 1, 1]
    assert mgr.take_pending_copies() == []
    assert mgr.usage() == KVCacheUsage(
        num_blocks=6, num_used_blocks=4, num_free_blocks=2,
        num_shared_blocks=2, num_exclusive_blocks=2,
    )
    mgr.check_integrity()


def test_a_written_shared_block_without_computed_tokens_is_replaced_without_a_copy() -> None:
    # Block size 2; the parent has blocks for 6 positions but only 3 computed tokens (e.g. after
    # rejected speculative tokens). The child writes positions 3..5: block 1 holds computed
    # position 2 and must be copied; block 2 holds nothing computed and is just replaced.
    mgr = KVCacheManager(num_blocks=6, block_size=2)
    assert mgr.allocate_slots("p", 0, 6)  # [0, 1, 2]
    mgr.fork("p", "c")
    assert mgr.num_blocks_needed("c", 3, 3) == 2
    assert mgr.allocate_slots("c", 3, 3)
    assert mgr.block_table("c") == [0, 3, 4]
    assert mgr.take_pending_copies() == [(1, 3)]
    assert _refs(mgr) == [2, 1, 1, 1, 1, 0]
    mgr.check_integrity()


def test_all_or_nothing_when_new_blocks_do_not_fit() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    assert mgr.allocate_slots("a", 0, 12)
    before = _snapshot(mgr, ["a", "b"])
    assert mgr.num_blocks_needed("b", 0, 5) == 2
    assert not mgr.allocate_slots("b", 0, 5)
    assert not mgr.allocate_slots("a", 12, 5)
    assert _snapshot(mgr, ["a", "b"]) == before
    assert "b" not in mgr
    mgr.check_integrity()


def test_all_or_nothing_when_the_copy_does_not_fit() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=4)
    assert mgr.allocate_slots("p", 0, 6)  # [0, 1]; one block free
    mgr.fork("p", "c")
    # Child writes positions 6..8: copy of block 1 plus a new block for position 8 = 2 > 1.
    assert mgr.num_blocks_needed("c", 6, 3) == 2
    before = _snapshot(mgr, ["p", "c"])
    assert not mgr.allocate_slots("c", 6, 3)
    assert _snapshot(mgr, ["p", "c"]) == before
    # One token only needs the copy, which fits.
    assert mgr.allocate_slots("c", 6, 1)
    assert mgr.take_pending_copies() == [(1, 2)]
    assert mgr.num_free_blocks == 0
    mgr.check_integrity()


def test_free_releases_blocks_tail_first_and_is_idempotent() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=4)
    assert mgr.allocate_slots("a", 0, 12)  # [0, 1, 2]
    mgr.free("a")
    assert "a" not in mgr and mgr.block_table("a") == []
    assert mgr.pool.free_block_ids() == [3, 4, 2, 1, 0]
    mgr.free("a")
    mgr.free("never-seen")
    assert mgr.num_free_blocks == 5
    mgr.check_integrity()


def test_freeing_one_sharer_keeps_the_blocks_for_the_other() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    assert mgr.allocate_slots("p", 0, 6)
    mgr.fork("p", "c")
    mgr.free("p")
    assert mgr.num_free_blocks == 2
    assert mgr.block_table("c") == [0, 1]
    assert _refs(mgr)[:2] == [1, 1]
    # Block 1 is no longer shared: the child writes into it in place.
    assert mgr.allocate_slots("c", 6, 1)
    assert mgr.take_pending_copies() == []
    mgr.free("c")
    assert mgr.num_free_blocks == 4
    mgr.check_integrity()


def test_a_pending_copy_into_a_freed_block_is_dropped() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    assert mgr.allocate_slots("p", 0, 6)
    mgr.fork("p", "c")
    mgr.fork("p", "d")
    assert mgr.allocate_slots("c", 6, 1)  # copy (1 -> 2)
    assert mgr.allocate_slots("d", 6, 1)  # copy (1 -> 3)
    mgr.free("c")  # preempted in the same step: its copy is useless
    assert mgr.take_pending_copies() == [(1, 3)]
    mgr.check_integrity()


def test_truncate_releases_the_blocks_past_the_kept_tokens() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    assert mgr.allocate_slots("a", 0, 11)  # positions 0..10: three blocks
    table = mgr.block_table("a")
    assert mgr.truncate("a", 7) == 1  # 0..6 need two blocks
    assert mgr.block_table("a") == table[:2] and mgr.num_free_blocks == 6
    assert mgr.truncate("a", 8) == 0 and mgr.truncate("unknown", 0) == 0
    mgr.fork("a", "b")
    assert mgr.truncate("b", 3) == 1 and mgr.num_free_blocks == 6  # shared: a still holds it
    mgr.check_integrity()
    with pytest.raises(ValueError, match="num_tokens"):
        mgr.truncate("a", -1)


def test_usage_counts_shared_and_exclusive_blocks() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=2)
    assert mgr.usage() == KVCacheUsage(10, 0, 10, 0, 0)
    assert mgr.allocate_slots("p", 0, 5)  # [0, 1, 2]
    mgr.fork("p", "c")
    assert mgr.allocate_slots("c", 5, 1)  # block 2 copied to 3
    assert mgr.allocate_slots("q", 0, 2)  # [4]
    usage = mgr.usage()
    assert usage == KVCacheUsage(
        num_blocks=10, num_used_blocks=5, num_free_blocks=5,
        num_shared_blocks=2, num_exclusive_blocks=3,
    )
    assert usage.usage == pytest.approx(0.5)


def test_check_integrity_catches_a_corrupted_table() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    assert mgr.allocate_slots("a", 0, 8)
    mgr.check_integrity()
    mgr._tables["a"][0].append(3)  # a block the pool thinks is free (group 0's table)
    with pytest.raises(BlockPoolIntegrityError, match="block 3 has ref_cnt 0 but appears 1"):
        mgr.check_integrity()
    mgr._tables["a"] = [[0, 0]]
    with pytest.raises(BlockPoolIntegrityError, match="repeat a block"):
        mgr.check_integrity()


class KVCacheMachine(RuleBasedStateMachine):
    """Several sequences scheduled step by step, against a simulated device KV cache.

    A step = some allocate_slots calls (new sequences and appends) and frees, then a "forward":
    take_pending_copies, apply them, write each scheduled token's value into its slot. A sequence
    forks or rolls back speculative tokens only while it has nothing scheduled, as in an engine.
    """

    @initialize(block_size=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(2, 32))
    def init(self, block_size: int, num_blocks: int) -> None:
        self.mgr = KVCacheManager(num_blocks, block_size)
        self.bs = block_size
        # Simulated K/V storage: one value per slot; fresh blocks keep stale values on purpose.
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tokens: dict[str, list[int]] = {}  # tokens whose K/V is written (computed)
        self.scheduled: dict[str, list[int]] = {}  # tokens to write in this step's forward
        self.next_value = 0
        self.next_seq = 0

    def _values(self, n: int) -> list[int]:
        self.next_value += n
        return list(range(self.next_value - n, self.next_value))

    def _schedule(self, seq_id: str, num_new: int) -> bool:
        computed = len(self.tokens.get(seq_id, []))
        needed = self.mgr.num_blocks_needed(seq_id, computed, num_new)
        free_before = self.mgr.num_free_blocks
        seq_ids = sorted(self.tokens) + [seq_id]
        before = _snapshot(self.mgr, seq_ids)
        ok = self.mgr.allocate_slots(seq_id, computed, num_new)
        if not ok:
            assert needed > free_before
            assert _snapshot(self.mgr, seq_ids) == before
            return False
        assert self.mgr.num_free_blocks == free_before - needed
        assert len(self.mgr.block_table(seq_id)) * self.bs >= computed + num_new
        self.tokens.setdefault(seq_id, [])
        self.scheduled[seq_id] = self._values(num_new)
        return True

    @precondition(lambda self: len(self.tokens) < 6)
    @rule(num_new=st.integers(0, 9), then_forward=st.booleans())
    def add_sequence(self, num_new: int, then_forward: bool) -> None:
        seq_id = f"s{self.next_seq}"
        self.next_seq += 1
        if not self._schedule(seq_id, num_new):
            assert seq_id not in self.mgr
        if then_forward:
            self.forward()

    @precondition(lambda self: set(self.tokens) - set(self.scheduled))
    @rule(data=st.data(), num_new=st.integers(1, 6), then_forward=st.booleans())
    def append(self, data: st.DataObject, num_new: int, then_forward: bool) -> None:
        seq_id = data.draw(st.sampled_from(sorted(set(self.tokens) - set(self.scheduled))))
        self._schedule(seq_id, num_new)
        if then_forward:
            self.forward()

    @precondition(lambda self: len(self.tokens) < 8 and set(self.tokens) - set(self.scheduled))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        # Only a parent whose K/V is fully written can fork; other sequences may be mid-step.
        parent = data.draw(st.sampled_from(sorted(set(self.tokens) - set(self.scheduled))))
        child = f"s{self.next_seq}"
        self.next_seq += 1
        free_before = self.mgr.num_free_blocks
        self.mgr.fork(parent, child)
        assert self.mgr.num_free_blocks == free_before
        assert self.mgr.block_table(child) == self.mgr.block_table(parent)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: set(self.tokens) - set(self.scheduled))
    @rule(data=st.data(), num_new=st.integers(1, 3), who=st.sampled_from(["child", "parent", "both"]))
    def fork_and_decode(self, data: st.DataObject, num_new: int, who: str) -> None:
        """Parallel sampling: fork, then decode the new branch and/or the parent in this step."""
        parent = data.draw(st.sampled_from(sorted(set(self.tokens) - set(self.scheduled))))
        child = f"s{self.next_seq}"
        self.next_seq += 1
        self.mgr.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        order = {"child": [child], "parent": [parent], "both": [child, parent]}[who]
        for seq_id in order:
            self._schedule(seq_id, num_new)

    @precondition(lambda self: any(self.tokens[s] for s in set(self.tokens) - set(self.scheduled)))
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        """Rejected speculative tokens: num_computed_tokens goes back; the blocks stay, or are truncated."""
        candidates = sorted(s for s in set(self.tokens) - set(self.scheduled) if self.tokens[s])
        seq_id = data.draw(st.sampled_from(candidates))
        k = data.draw(st.integers(1, len(self.tokens[seq_id])))
        del self.tokens[seq_id][-k:]
        if data.draw(st.booleans()):
            n = len(self.tokens[seq_id])
            before = len(self.mgr.block_table(seq_id))
            free_before = self.mgr.num_free_blocks
            released = self.mgr.truncate(seq_id, n)
            assert len(self.mgr.block_table(seq_id)) == min(before, -(-n // self.bs))
            assert released == before - len(self.mgr.block_table(seq_id))
            assert self.mgr.num_free_blocks >= free_before  # shared blocks only lose a reference

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.mgr.free(seq_id)
        del self.tokens[seq_id]
        self.scheduled.pop(seq_id, None)
        assert seq_id not in self.mgr
        self.mgr.free(seq_id)  # idempotent

    @rule()
    def forward(self) -> None:
        copies = self.mgr.take_pending_copies()
        assert self.mgr.take_pending_copies() == []
        dsts = [dst for _, dst in copies]
        assert len(set(dsts)) == len(dsts), "copy destinations must be distinct"
        # Gather every source, then scatter, as a batched device copy would.
        gathered = [list(self.kv[src]) for src, _ in copies]
        for (_, dst), data in zip(copies, gathered):
            self.kv[dst] = data
        for seq_id, values in self.scheduled.items():
            table = self.mgr.block_table(seq_id)
            start = len(self.tokens[seq_id])
            for pos, value in enumerate(values, start):
                self.kv[table[pos // self.bs]][pos % self.bs] = value
            self.tokens[seq_id].extend(values)
        self.scheduled.clear()
        self.check_contents()

    def check_contents(self) -> None:
        """Every sequence reads its own tokens back through its block table."""
        for seq_id, tokens in self.tokens.items():
            table = self.mgr.block_table(seq_id)
            read = [self.kv[table[pos // self.bs]][pos % self.bs] for pos in range(len(tokens))]
            assert read == tokens, f"{seq_id}: table {table} reads {read}, expected {tokens}"

    @invariant()
    def pool_is_consistent(self) -> None:
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_integrity()
        pool = self.mgr.pool
        assert len(pool.free_block_ids()) == pool.num_free_blocks == self.mgr.num_free_blocks
        usage = self.mgr.usage()
        assert usage.num_used_blocks + usage.num_free_blocks == usage.num_blocks
        assert usage.num_shared_blocks + usage.num_exclusive_blocks == usage.num_used_blocks
        assert set(self.tokens) == {s for s in self.tokens if s in self.mgr}
        for seq_id, tokens in self.tokens.items():
            covered = len(self.mgr.block_table(seq_id)) * self.bs
            assert covered >= len(tokens) + len(self.scheduled.get(seq_id, []))

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):
            return
        if not self.scheduled:
            self.check_contents()
        for seq_id in list(self.tokens):
            self.mgr.free(seq_id)
        assert self.mgr.pool.num_used_blocks == 0
        assert self.mgr.num_free_blocks == self.mgr.pool.num_blocks
        # Every pending copy's destination was freed, so none is left to do.
        assert self.mgr.take_pending_copies() == []
        self.mgr.check_integrity()


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
