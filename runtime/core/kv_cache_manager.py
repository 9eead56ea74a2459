"""The KV cache manager: one block table per sequence, on top of the block pool.

A block table maps a sequence's token positions to KV cache slots::

    block_size = 4, block_table = [7, 2, 9]

    position   0  1  2  3 | 4  5  6  7 | 8  9  .  .
    block          7      |     2      |     9
    slot = block_table[pos // block_size] * block_size + pos % block_size

The scheduler moves counters (``num_computed_tokens``, tokens scheduled this step) and asks
this manager for room; the manager never sees arrays. Sharing is by reference count: a
``fork`` (parallel sampling, beam search) gives the child the parent's blocks, and the first
write into a shared block replaces it, in the writer's table only, by a fresh one
(copy-on-write)::

    parent  [7, 2, 9]  9 holds positions 8..9 of 4
    fork -> child [7, 2, 9]               ref_cnt: 7=2, 2=2, 9=2
    child writes position 10 (block 9, shared, holds computed tokens 8..9):
            child [7, 2, 4]  + pending copy (9 -> 4)   ref_cnt: 9=1, 4=1
    parent writes position 10: block 9 now has ref_cnt 1 -> written in place, no copy

The pending copies are handed to the model runner with ``take_pending_copies`` and must be
applied on the device *before* the step's forward writes any new K/V.

KV cache groups (sliding-window models; vLLM's hybrid KV cache manager is the model; how layers are grouped:
kv_cache_groups.py): every group has a table per sequence and draws block ids from the one pool. A sliding
group's table keeps only the blocks a future query can read; those wholly older than the window of the next
position are released (to the prefix cache's free queue, hash kept) and replaced by the manager's null block,
which no kernel reads::

    block_size 4, W = 6, 14 tokens computed: the next query (p = 14) sees keys 9..14
    full group     [7, 2, 9, 5]
    sliding group  [N, N, 3, 8]     N = the null block; positions 0..7 released

A prefix-cache hit then needs, in a sliding group, only the blocks the first uncomputed position's window
covers (find_cached_prefix); the hit is the longest prefix that every group can serve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .block_pool import BlockPool, BlockPoolIntegrityError
from .kv_cache_groups import KVCacheGroups, check_window, kv_cache_groups  # noqa: F401  (imported from here too)
from .prefix_caching import CachedPrefix, PrefixCaching  # noqa: F401  (imported from here too)


@dataclass(frozen=True)
class KVCacheUsage:
    """A snapshot of the pool for stats and logs."""

    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_shared_blocks: int  # ref_cnt > 1: held by several sequences (after fork)
    num_exclusive_blocks: int  # ref_cnt == 1

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0..1.0."""
        return self.num_used_blocks / self.num_blocks


@dataclass(frozen=True)
class _SlotPlan:
    """What allocate_slots would do; computed without changing anything."""

    cow_indices: tuple[int, ...]  # table indices of shared blocks that will be written into
    num_computed_tokens: int
    num_new_table_blocks: int  # blocks appended to the end of the table

    @property
    def num_blocks_needed(self) -> int:
        return self.num_new_table_blocks + len(self.cow_indices)


def _check_count(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


class KVCacheManager(PrefixCaching):
    """Owns a BlockPool and the block tables of every live sequence (keyed by a str id), one per KV cache
    group. `group_windows`: each group's sliding window, None for global attention (the default: one global
    group, the layout of a model without sliding windows)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 group_windows: Sequence[int | None] = (None,), long_prompt_threshold: int | None = None) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        # LongRoPE's original_max_position_embeddings (models/rope.py), None for every other rope: see prefix_key.
        self.long_prompt_threshold = long_prompt_threshold
        self.group_windows = tuple(None if w is None else check_window(w) for w in group_windows)
        if not self.group_windows:
            raise ValueError("group_windows: at least one KV cache group")
        # The block a sliding group's released entries point at: held here for good, never read by a kernel.
        self.null_block: int | None = None
        if any(w is not None for w in self.group_windows):
            if num_blocks < 2:
                raise ValueError(f"num_blocks must be at least 2 with a sliding window group, got {num_blocks}")
            self.null_block = self.pool.allocate(1)[0]
        self._tables: dict[str, list[list[int]]] = {}  # seq_id -> a table per group
        self._pending_copies: list[tuple[int, int]] = []
        # Prefix caching: per sequence, per group, the chained hashes of its full blocks hashed so far.
        self._hashes: dict[str, list[list[int]]] = {}

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: str, group: int = 0) -> list[int]:
        """A copy of the sequence's block table of `group` (empty for an unknown id)."""
        tables = self._tables.get(seq_id)
        return list(tables[group]) if tables else []

    def block_tables(self, seq_id: str) -> list[list[int]]:
        """Copies of the sequence's block tables, one per group (empty lists for an unknown id)."""
        return [self.block_table(seq_id, g) for g in range(self.num_groups)]

    def num_blocks_needed(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Free blocks that ``allocate_slots`` with these arguments would take, copies included (an upper
        bound with sliding groups: the blocks allocate_slots first releases are not subtracted)."""
        return sum(p.num_blocks_needed for p in self._plans(seq_id, num_computed_tokens, num_new_tokens))

    def _live(self, table: Sequence[int]) -> list[int]:
        """The table's entries that hold a reference (the null block's do not)."""
        null = self.null_block
        return list(table) if null is None else [b for b in table if b != null]

    def release_outside_window(self, seq_id: str, num_computed_tokens: int) -> int:
        """In each sliding group, release the blocks whose every position is older than the window of
        position `num_computed_tokens` (the next query; later ones see even less of the past) and point
        their entries at the null block. Cached blocks keep their hash (free, reusable by a prefix hit).
        Returns the number of references dropped::

            block_size 4, W = 6, num_computed_tokens 14: window 9..14
            sliding [A, B, C, D] -> [N, N, C, D]     A (0..3) and B (4..7) released
        """
        self._check_seq_id(seq_id)
        _check_count("num_computed_tokens", num_computed_tokens)
        tables = self._tables.get(seq_id)
        if not tables or self.null_block is None:
            return 0
        dropped: list[int] = []
        for window, table in zip(self.group_windows, tables):
            if window is None:
                continue
            old = min(len(table), max(0, num_computed_tokens - window + 1) // self.pool.block_size)
            for i in range(old - 1, -1, -1):  # newest first: the walk stops at the first released entry
                if table[i] == self.null_block:
                    break
                dropped.append(table[i])
                table[i] = self.null_block
        self.pool.free(reversed(dropped))  # oldest first into the free queue: the first evicted
        self._drop_dead_copies()
        return len(dropped)

    def allocate_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Make room to write ``num_new_tokens`` K/V entries after ``num_computed_tokens``.

        Afterwards the table covers positions ``[0, num_computed_tokens + num_new_tokens)``.
        Blocks in the written range ``[num_computed_tokens, +num_new_tokens)`` that are shared
        are swapped for fresh ones (copy-on-write); a copy is recorded only when the old block
        holds computed tokens that must survive (positions below ``num_computed_tokens``)::

            block_size 4, computed 6, new 5: writes positions 6..10
            table  [A, B]      B shared (ref 2), holds computed 4..5
            after  [A, B', C]  pending copy (B -> B'); B ref 1; C appended

        All-or-nothing: if the free blocks do not cover the appended blocks plus the copies,
        nothing changes and False is returned (the scheduler then preempts or waits).
        The sequence is registered on its first successful call.
        """
        if seq_id in self._tables:
            self.release_outside_window(seq_id, num_computed_tokens)
        plans = self._plans(seq_id, num_computed_tokens, num_new_tokens)
        if sum(p.num_blocks_needed for p in plans) > self.pool.num_free_blocks:
            return False
        tables = self._tables.setdefault(seq_id, [[] for _ in self.group_windows])
        block_size = self.pool.block_size
        for plan, table in zip(plans, tables):
            fresh = self.pool.allocate(plan.num_blocks_needed)
            for index, new_block in zip(plan.cow_indices, fresh):
                old_block = table[index]
                table[index] = new_block
                if index * block_size < plan.num_computed_tokens:
                    self._pending_copies.append((old_block, new_block))
                # Still referenced by the other sharers (ref_cnt was > 1), so this never frees it.
                self.pool.free([old_block])
            table.extend(fresh[len(plan.cow_indices):])
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared (each ref_cnt + 1); nothing is copied.

        Fork between steps, after the parent's K/V for its computed tokens is written: the
        child starts with the parent's ``num_computed_tokens``.
        """
        if parent_id not in self._tables:
            raise ValueError(f"fork: unknown parent sequence {parent_id!r}")
        self._check_seq_id(child_id)
        if child_id in self._tables:
            raise ValueError(f"fork: child sequence {child_id!r} already has a block table")
        parent_tables = self._tables[parent_id]
        self.pool.incref([b for table in parent_tables for b in self._live(table)])
        self._tables[child_id] = [list(table) for table in parent_tables]
        if parent_id in self._hashes:
            self._hashes[child_id] = [list(chain) for chain in self._hashes[parent_id]]

    def free(self, seq_id: str) -> None:
        """Release the sequence's blocks and forget it; a no-op for an unknown id.

        Tail first: blocks reaching ref_cnt 0 enter the free queue last-block-first, so an LRU
        prefix cache would evict a chain's tail before the prefix other requests may share.
        """
        tables = self._tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        if tables:
            for table in tables:
                self.pool.free(reversed(self._live(table)))
            self._drop_dead_copies()

    def _drop_dead_copies(self) -> None:
        # A copy into a block nobody holds any more is useless; dropping it also keeps
        # the destinations of the pending copies distinct if that block is reused.
        if self._pending_copies:
            self._pending_copies = [(src, dst) for src, dst in self._pending_copies if self.pool.ref_cnt(dst) > 0]

    def truncate(self, seq_id: str, num_tokens: int) -> int:
        """Keep only the blocks that hold positions ``[0, num_tokens)``; release the rest (tail first).

        A speculative verify step writes K/V for 1 + k tokens; when drafts are rejected, the slots
        past the last accepted token are given back here::

            block_size 4, 6 tokens computed, verify writes 6..10 (1 + 4 drafts), 1 draft accepted
            before  [A, B, C]   C holds positions 8..10 (rejected drafts only)
            truncate(8) -> [A, B]   C released; stale K/V at 7 is overwritten by the next step

        Hashes registered for blocks that are kept stay (they only ever cover computed, accepted
        tokens); a chain longer than the kept blocks is cut. Returns the number of blocks released.
        """
        self._check_seq_id(seq_id)
        _check_count("num_tokens", num_tokens)
        tables = self._tables.get(seq_id)
        keep = -(-num_tokens // self.pool.block_size)
        if tables is None or len(tables[0]) <= keep:
            return 0
        released = 0
        for g, table in enumerate(tables):
            dropped = self._live(table[keep:])
            del table[keep:]
            chains = self._hashes.get(seq_id)
            if chains is not None and len(chains[g]) > keep:
                del chains[g][keep:]
            self.pool.free(reversed(dropped))
            released += len(dropped)
        self._drop_dead_copies()
        return released

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Return and clear the ``(src_block, dst_block)`` copies recorded since the last call.

        Apply them before the forward of this step writes new K/V. Destinations are distinct,
        but within one step a source may be freed and handed out again as a later copy's
        destination: apply them in list order, or gather all sources before scattering
        (numpy's ``k[dsts] = k[srcs]`` does exactly that).
        """
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def check_integrity(self) -> None:
        """Raise BlockPoolIntegrityError unless the pool agrees with the live block tables."""
        live_tables = []
        for seq_id, tables in self._tables.items():
            if len({len(t) for t in tables}) != 1:
                raise BlockPoolIntegrityError(f"block tables of {seq_id!r} differ in length: {tables}")
            entries = [b for table in tables for b in self._live(table)]
            if len(set(entries)) != len(entries):
                raise BlockPoolIntegrityError(f"block tables of {seq_id!r} repeat a block: {tables}")
            for window, table in zip(self.group_windows, tables):
                if window is None and self.null_block in table:
                    raise BlockPoolIntegrityError(f"a global group's table of {seq_id!r} holds the null block")
            live_tables.append(entries)
        if self.null_block is not None:
            live_tables.append([self.null_block])  # the manager's own reference
        self.pool.check_integrity(live_tables)

    def usage(self) -> KVCacheUsage:
        """Blocks in use by sequences (the null block not counted), free ones, and the shared ones."""
        live = {block_id for tables in self._tables.values() for table in tables for block_id in self._live(table)}
        num_shared = sum(1 for block_id in live if self.pool.ref_cnt(block_id) > 1)
        held = 0 if self.null_block is None else 1
        return KVCacheUsage(
            num_blocks=self.pool.num_blocks - held,
            num_used_blocks=self.pool.num_used_blocks - held,
            num_free_blocks=self.pool.num_free_blocks,
            num_shared_blocks=num_shared,
            num_exclusive_blocks=len(live) - num_shared,
        )

    def _plans(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> list[_SlotPlan]:
        self._check_seq_id(seq_id)
        _check_count("num_computed_tokens", num_computed_tokens)
        _check_count("num_new_tokens", num_new_tokens)
        tables = self._tables.get(seq_id) or [[] for _ in self.group_windows]
        return [self._plan(seq_id, table, num_computed_tokens, num_new_tokens) for table in tables]

    def _plan(self, seq_id: str, table: list[int], num_computed_tokens: int, num_new_tokens: int) -> _SlotPlan:
        block_size = self.pool.block_size
        capacity = len(table) * block_size
        if num_computed_tokens > capacity:
            # Computed tokens' K/V must already live in the table's blocks.
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} exceeds the {capacity} token slots "
                f"of sequence {seq_id!r}'s block table"
            )
        num_tokens = num_computed_tokens + num_new_tokens
        num_required = -(-num_tokens // block_size)
        cow_indices: tuple[int, ...] = ()
        if num_new_tokens > 0:
            first_written = num_computed_tokens // block_size
            last_written = min(len(table), num_required)  # exclusive; existing blocks only
            cow_indices = tuple(
                i for i in range(first_written, last_written)
                if table[i] != self.null_block and self.pool.ref_cnt(table[i]) > 1
            )
        return _SlotPlan(
            cow_indices=cow_indices,
            num_computed_tokens=num_computed_tokens,
            num_new_table_blocks=max(0, num_required - len(table)),
        )

    @staticmethod
    def _check_seq_id(seq_id: str) -> None:
        if not isinstance(seq_id, str):
            raise ValueError(f"seq_id must be a str, got {seq_id!r}")
