"""The KV manager's sliding-window groups (runtime/core/kv_cache_manager.py): layers cut into groups, a sliding
group's blocks released once they left the window of every future query, the prefix cache kept right, and
the contract with the kernels (tables whose released entries point at the null block read the same as whole
tables, even when the released blocks are reused and overwritten)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.cupy_kernels.reference import paged_attention as pa
from pagedserve.runtime.core.kv_cache_manager import KVCacheManager, kv_cache_groups


def gemma3_windows(num_layers: int, window: int = 512, every: int = 6) -> list[int | None]:
    """Gemma 3's pattern: every sixth layer global, the others local."""
    return [None if (n + 1) % every == 0 else window for n in range(num_layers)]


def test_layers_alike_make_one_group_with_a_tensor_per_layer():
    groups = kv_cache_groups([None] * 4)
    assert groups.windows == (None,) and groups.layer_group == (0,) * 4 and groups.layer_tensor == (0, 1, 2, 3)
    assert groups.num_tensors == 4


@pytest.mark.parametrize("num_layers,sizes", [(18, (3, 6)), (26, (4, 7)), (12, (2, 6))])
def test_gemma3_layers_share_tensors_one_layer_per_group(num_layers, sizes):
    """270M (18 layers: 3 global), 1B (26: 4 global): groups of the global count; each tensor holds at most one
    layer of each group, and a group's layers sit in distinct tensors."""
    size, num_groups = sizes
    windows = gemma3_windows(num_layers)
    groups = kv_cache_groups(windows)
    assert groups.num_tensors == size and len(groups.windows) == num_groups
    pairs = list(zip(groups.layer_group, groups.layer_tensor))
    assert len(set(pairs)) == num_layers  # no two layers share a (group, tensor) slot
    for layer, (g, _) in enumerate(pairs):
        assert groups.windows[g] == windows[layer]
    assert groups.windows.count(None) == 1


def test_kinds_within_a_quarter_of_each_other_take_the_larger_count():
    groups = kv_cache_groups([None] * 5 + [64] * 6)
    assert groups.windows == (None, 64) and groups.num_tensors == 6
    groups = kv_cache_groups([None] * 4 + [64] * 5)  # 5 is not under 1.25 x 4: groups of 4
    assert groups.windows == (None, 64, 64) and groups.num_tensors == 4


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_a_bad_window_is_refused(bad):
    with pytest.raises(ValueError, match="sliding_window"):
        kv_cache_groups([None, bad])
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(8, 4, group_windows=(None, bad))


def test_blocks_that_left_the_window_are_released_and_not_counted():
    kv = KVCacheManager(num_blocks=16, block_size=4, group_windows=(None, 6))
    null = kv.null_block
    assert kv.usage().num_used_blocks == 0 and kv.usage().num_blocks == 15
    assert kv.allocate_slots("a", 0, 14)  # positions 0..13: 4 blocks in each group
    assert kv.usage().num_used_blocks == 8
    full_before = kv.block_table("a", 0)
    assert kv.allocate_slots("a", 14, 1)  # the query at 14 sees 9..14: blocks 0 (0..3), 1 (4..7) leave
    assert kv.block_table("a", 0) == full_before
    sliding = kv.block_table("a", 1)
    assert sliding[:2] == [null, null] and null not in sliding[2:]
    assert kv.usage().num_used_blocks == 6 and kv.num_free_blocks == 9
    kv.check_integrity()
    assert kv.release_outside_window("a", 14) == 0  # nothing more to release
    kv.free("a")
    assert kv.usage().num_used_blocks == 0
    kv.check_integrity()


@pytest.mark.parametrize("window,block_size", [(512, 16), (37, 16), (5, 4), (16, 16)])
def test_a_long_decode_holds_a_bounded_number_of_sliding_blocks(window, block_size):
    """2,000 tokens over the window: the sliding group holds at most the window's blocks (plus the one being
    written) at every step, the global group all of them."""
    kv = KVCacheManager(num_blocks=2000 // block_size + window // block_size + 4, block_size=block_size,
                        group_windows=(None, window))
    computed = 0
    for new in [300] + [1] * 1700:
        assert kv.allocate_slots("a", computed, new)
        computed += new
        kv.release_outside_window("a", computed)
        live = [b for b in kv.block_table("a", 1) if b != kv.null_block]
        assert len(live) <= -(-(window - 1) // block_size) + 1
        assert len(kv.block_table("a", 0)) == -(-computed // block_size)
    kv.check_integrity()


def test_fork_truncate_and_free_keep_the_counts_right():
    kv = KVCacheManager(num_blocks=32, block_size=4, group_windows=(6, None))
    assert kv.allocate_slots("p", 0, 18)
    kv.release_outside_window("p", 18)
    kv.fork("p", "c")
    kv.check_integrity()
    assert kv.allocate_slots("c", 18, 3)  # writes into the shared last block: a copy in each group
    assert len(kv.take_pending_copies()) == 2
    assert kv.truncate("c", 19) == 2  # 21 -> 19 tokens: the sixth block of each group
    kv.check_integrity()
    kv.free("p")
    kv.free("c")
    assert kv.usage().num_used_blocks == 0
    kv.check_integrity()


def test_a_prefix_hit_needs_only_the_window_of_a_sliding_group():
    """A's 40 tokens cached; its old sliding blocks evicted: B, on the same 40 tokens + 5, still hits all 10
    blocks (its first new token's window needs blocks 8 and 9 of the sliding group only)."""
    kv = KVCacheManager(num_blocks=21, block_size=4, enable_prefix_caching=True, group_windows=(None, 6))
    prompt = list(range(100, 140))
    assert kv.allocate_slots("a", 0, 40)
    kv.cache_full_blocks("a", prompt, 40)
    sliding_a = kv.block_table("a", 1)
    kv.release_outside_window("a", 40)  # sliding blocks 0..7 released, hashes kept
    kv.free("a")
    taken = kv.pool.allocate(8)  # evicts exactly the eight released sliding blocks (first in the queue)
    assert sorted(taken) == sorted(sliding_a[:8])
    hit = kv.find_cached_prefix(prompt + [1, 2, 3, 4, 5])
    assert len(hit) == 10
    assert hit.group_blocks[1] == [kv.null_block] * 8 + sliding_a[8:]
    kv.pool.free(taken)
    assert kv.allocate_with_prefix("b", hit, 5)
    kv.check_integrity()
    kv.free("b")
    kv.check_integrity()


def test_a_sliding_group_missing_its_window_cuts_the_hit_back():
    """Every global block of A's prefix cached, its sliding blocks all evicted: the window of any hit's first
    new token lacks a block, so the hit is cut back to nothing."""
    kv = KVCacheManager(num_blocks=21, block_size=4, enable_prefix_caching=True, group_windows=(6, None))
    prompt = list(range(100, 140))
    assert kv.allocate_slots("a", 0, 40)
    kv.cache_full_blocks("a", prompt, 40)
    sliding_a = kv.block_table("a", 0)
    kv.release_outside_window("a", 40)
    kv.free("a")  # the sliding group's blocks first: the queue is sliding 0..7, sliding 9, 8, global 9..0
    assert sorted(kv.pool.allocate(10)) == sorted(sliding_a)
    assert kv.pool.num_cached_blocks == 10  # the global group's, all of them
    hit = kv.find_cached_prefix(prompt + [1])
    assert len(hit) == 0 and hit.group_blocks == ([], [])


def test_a_released_but_cached_sliding_block_is_revived_by_a_hit():
    kv = KVCacheManager(num_blocks=40, block_size=4, enable_prefix_caching=True, group_windows=(None, 6))
    prompt = list(range(40))
    assert kv.allocate_slots("a", 0, 40)
    kv.cache_full_blocks("a", prompt, 40)
    kv.release_outside_window("a", 40)
    sliding_a = kv.block_table("a", 1)
    hit = kv.find_cached_prefix(prompt[:38] + [7, 7, 7])  # differs in block 9: a hit of 9 blocks
    assert len(hit) == 9
    first_needed = (36 - 6 + 1) // 4  # 7: block 7 was released, its hash kept
    assert sliding_a[7] == kv.null_block
    assert hit.group_blocks[1][first_needed:] != [kv.null_block] * 2
    assert kv.allocate_with_prefix("b", hit, 5)
    kv.check_integrity()


def test_one_global_group_behaves_as_before():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    assert kv.null_block is None
    assert kv.allocate_slots("a", 0, 9)
    assert kv.release_outside_window("a", 9) == 0
    assert kv.block_table("a") == [0, 1, 2] and kv.block_tables("a") == [[0, 1, 2]]
    kv.cache_full_blocks("a", list(range(9)), 9)
    assert kv.find_cached_prefix(list(range(9))) == [0, 1]


def test_the_kernels_read_released_tables_as_whole_ones():
    """2,000 tokens over a 512 window (block 16): a prompt of 1,800 in chunks of 300, then 200 decodes. At each
    step the sliding group's table (released entries: the null block; released blocks handed to another
    sequence and overwritten with NaN) gives the same bits as the sequence's whole table."""
    rng = np.random.default_rng(0)
    block_size, window, kv_heads, dim = 16, 512, 1, 16
    kv = KVCacheManager(num_blocks=260, block_size=block_size, group_windows=(window,))
    k_cache = np.full((260, block_size, kv_heads, dim), np.nan, np.float32)
    v_cache = k_cache.copy()
    keys = rng.standard_normal((2000, kv_heads, dim)).astype(np.float32)
    values = rng.standard_normal((2000, kv_heads, dim)).astype(np.float32)
    whole_k, whole_v = np.zeros((125, block_size, kv_heads, dim), np.float32), np.zeros((125, block_size, kv_heads,
                                                                                            dim), np.float32)
    whole_k.reshape(-1, kv_heads, dim)[:2000], whole_v.reshape(-1, kv_heads, dim)[:2000] = keys, values
    computed = 0
    for step, new in enumerate([300] * 6 + [1] * 200):
        assert kv.allocate_slots("a", computed, new)
        table = kv.block_table("a")
        pos = np.arange(computed, computed + new)
        slots = np.array(table)[pos // block_size] * block_size + pos % block_size
        k_cache.reshape(-1, kv_heads, dim)[slots], v_cache.reshape(-1, kv_heads, dim)[slots] = keys[pos], values[pos]
        computed += new
        query = rng.standard_normal((new, 2, dim)).astype(np.float32)
        qsl, lens = np.array([0, new]), np.array([computed])
        got = pa.paged_attention(query, k_cache, v_cache, qsl, lens, np.array([table]), 0.25, sliding_window=window)
        want = pa.paged_attention(query, whole_k, whole_v, qsl, lens, np.arange(125)[None, :], 0.25,
                                  sliding_window=window)
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        released = kv.release_outside_window("a", computed)
        if released:  # another sequence takes the released blocks and writes over them
            assert kv.allocate_slots(f"other{step}", 0, released * block_size)
            for b in kv.block_table(f"other{step}"):
                k_cache[b] = v_cache[b] = np.nan
            kv.free(f"other{step}")
    assert computed == 2000 and len([b for b in kv.block_table("a") if b != kv.null_block]) <= 33
    kv.check_integrity()


class _StubModel:
    windows = [512, 512, None, 512, 512, None]


class _GroupReadingModel(_StubModel):
    reads_kv_cache_groups = True


def test_the_worker_groups_layers_only_for_a_model_that_reads_groups():
    from pagedserve.runtime.worker.worker import model_kv_groups

    assert model_kv_groups(_StubModel(), 6).windows == (None,)  # windows in the kernels, every block kept
    groups = model_kv_groups(_GroupReadingModel(), 6)
    assert groups.windows == (512, 512, None) and groups.num_tensors == 2
    assert model_kv_groups(object(), 3).layer_tensor == (0, 1, 2)


def test_layers_of_different_groups_share_an_array_pair():
    from model_factory import random_model

    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.kv_cache import allocate_kv_caches, kv_bytes_per_block

    cfg = random_model(layers=6)[0]
    groups = kv_cache_groups(_StubModel.windows)
    pairs = allocate_kv_caches(cfg, 4, 16, get_backend("cpu"), num_arrays=groups.num_tensors)
    per_layer = [pairs[t] for t in groups.layer_tensor]
    assert len(pairs) == 2 and per_layer[0] is per_layer[2] and per_layer[0] is not per_layer[1]
    assert kv_bytes_per_block(cfg, 16, 4, num_arrays=2) * 3 == kv_bytes_per_block(cfg, 16, 4)


class SlidingKVMachine(RuleBasedStateMachine):
    """Sequences scheduled step by step over a global and a sliding group (or a sliding group alone), against a
    simulated KV store: each step allocates, applies the copies, writes every scheduled token into each
    group's slot, takes back rejected drafts (speculative decoding), then releases what left the window, as
    the scheduler does. After every step each group reads back, through its table, every position the next
    query may see; a released entry is the null block; no block leaks. With prefix caching, a sequence's
    tokens follow one of two streams (token = stream * 1000 + position), so new sequences hit what others
    (live, freed or released) cached, and the blocks a hit hands over must hold what they claim."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), window=st.integers(1, 9), with_global=st.booleans(),
                num_blocks=st.integers(3, 40), prefix=st.booleans())
    def init(self, block_size: int, window: int, with_global: bool, num_blocks: int, prefix: bool) -> None:
        self.windows = (None, window) if with_global else (window,)
        self.mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix, group_windows=self.windows)
        self.stream: dict[str, int] = {}
        self.bs, self.window = block_size, window
        self.kv: dict[int, list] = {}  # block -> its slots' values (fresh blocks keep stale values)
        self.tokens: dict[str, list[int]] = {}
        self.scheduled: dict[str, list[int]] = {}
        self.reject: dict[str, tuple[int, bool]] = {}  # drafts rejected after the step, and whether truncated
        self.next_value = self.next_seq = 0

    def _schedule(self, seq_id: str, num_new: int) -> bool:
        computed = len(self.tokens.get(seq_id, []))
        if seq_id in self.mgr:
            self.mgr.release_outside_window(seq_id, computed)  # what allocate_slots does first
        needed = self.mgr.num_blocks_needed(seq_id, computed, num_new)
        free_before = self.mgr.num_free_blocks
        if not self.mgr.allocate_slots(seq_id, computed, num_new):
            assert needed > free_before and self.mgr.num_free_blocks == free_before
            return False
        assert self.mgr.num_free_blocks == free_before - needed
        self.tokens.setdefault(seq_id, [])
        stream = self.stream.setdefault(seq_id, self.next_seq % 2)
        self.scheduled[seq_id] = [stream * 1000 + p for p in range(computed, computed + num_new)]
        return True

    def _idle(self) -> list[str]:
        return sorted(set(self.tokens) - set(self.scheduled))

    @precondition(lambda self: len(self.tokens) < 5)
    @rule(num_new=st.integers(0, 12))
    def add_sequence(self, num_new: int) -> None:
        self.next_seq += 1
        seq_id = f"s{self.next_seq}"
        stream = self.stream[seq_id] = self.next_seq % 2
        prompt = [stream * 1000 + p for p in range(num_new)]
        hit = self.mgr.find_cached_prefix(prompt)
        if not hit:
            self._schedule(seq_id, num_new)
            return
        event("prefix hit")
        cached = len(hit) * self.bs
        for g, blocks in enumerate(hit.group_blocks):  # what a hit hands over holds what it claims
            window = self.windows[g]
            first = 0 if window is None else max(0, cached - window + 1)
            for pos in range(first, cached):
                assert self.kv[blocks[pos // self.bs]][pos % self.bs] == (g, prompt[pos]), (g, pos)
        if self.mgr.allocate_with_prefix(seq_id, hit, num_new - cached):
            self.tokens[seq_id] = prompt[:cached]
            self.scheduled[seq_id] = prompt[cached:]

    @precondition(lambda self: self._idle())
    @rule(data=st.data(), num_new=st.integers(1, 7), drafts_rejected=st.integers(0, 3), truncate=st.booleans())
    def append(self, data: st.DataObject, num_new: int, drafts_rejected: int, truncate: bool) -> None:
        seq_id = data.draw(st.sampled_from(self._idle()))
        if self._schedule(seq_id, num_new) and drafts_rejected:
            self.reject[seq_id] = (min(drafts_rejected, num_new - 1), truncate)

    @precondition(lambda self: self._idle() and len(self.tokens) < 7)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self._idle()))
        self.next_seq += 1
        child = f"s{self.next_seq}"
        free_before = self.mgr.num_free_blocks
        self.mgr.fork(parent, child)
        assert self.mgr.num_free_blocks == free_before and self.mgr.block_tables(child) == self.mgr.block_tables(parent)
        self.tokens[child] = list(self.tokens[parent])
        self.stream[child] = self.stream[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.mgr.free(seq_id)
        del self.tokens[seq_id]
        self.scheduled.pop(seq_id, None)
        self.reject.pop(seq_id, None)

    @rule()
    def forward(self) -> None:
        copies = self.mgr.take_pending_copies()
        gathered = [list(self.kv.get(src, [None] * self.bs)) for src, _ in copies]
        for (_, dst), values in zip(copies, gathered):
            self.kv[dst] = values
        for seq_id, values in self.scheduled.items():
            start = len(self.tokens[seq_id])
            for g, table in enumerate(self.mgr.block_tables(seq_id)):
                for pos, value in enumerate(values, start):
                    assert table[pos // self.bs] != self.mgr.null_block, "a write into a released entry"
                    self.kv.setdefault(table[pos // self.bs], [None] * self.bs)[pos % self.bs] = (g, value)
            self.tokens[seq_id].extend(values)
        for seq_id in self.scheduled:
            rejected, truncate = self.reject.pop(seq_id, (0, False))
            if rejected:
                del self.tokens[seq_id][-rejected:]
                if truncate:
                    self.mgr.truncate(seq_id, len(self.tokens[seq_id]))
            self.mgr.cache_full_blocks(seq_id, self.tokens[seq_id], len(self.tokens[seq_id]))
            self.mgr.release_outside_window(seq_id, len(self.tokens[seq_id]))
        self.scheduled.clear()
        self.check_contents()

    def check_contents(self) -> None:
        for seq_id, tokens in self.tokens.items():
            n = len(tokens)
            for g, (window, table) in enumerate(zip(self.windows, self.mgr.block_tables(seq_id))):
                first = 0 if window is None else max(0, n - window + 1)  # the next query's oldest key
                for pos in range(first, n):
                    block = table[pos // self.bs]
                    assert block != self.mgr.null_block, f"{seq_id} group {g}: position {pos} released"
                    assert self.kv[block][pos % self.bs] == (g, tokens[pos]), (seq_id, g, pos)
                if window is not None:  # blocks wholly older than the window are released
                    assert all(b == self.mgr.null_block for b in table[: first // self.bs])

    @invariant()
    def pool_is_consistent(self) -> None:
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_integrity()
        usage = self.mgr.usage()
        assert usage.num_used_blocks + usage.num_free_blocks == usage.num_blocks

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):
            return
        for seq_id in list(self.tokens):
            self.mgr.free(seq_id)
        assert self.mgr.usage().num_used_blocks == 0 and self.mgr.take_pending_copies() == []
        self.mgr.check_integrity()


TestSlidingKVMachine = SlidingKVMachine.TestCase
TestSlidingKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
