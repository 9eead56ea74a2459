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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .block_pool import BlockPool, BlockPoolIntegrityError


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


class KVCacheManager:
    """Owns a BlockPool and the block table of every live sequence (keyed by a str id)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self._block_tables: dict[str, list[int]] = {}
        self._pending_copies: list[tuple[int, int]] = []
        # Prefix caching: the chained hashes of each sequence's full blocks hashed so far.
        self._hashes: dict[str, list[int]] = {}

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._block_tables

    def block_table(self, seq_id: str) -> list[int]:
        """A copy of the sequence's block table (empty for an unknown id)."""
        return list(self._block_tables.get(seq_id, ()))

    def num_blocks_needed(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Free blocks that ``allocate_slots`` with these arguments would take, copies included."""
        return self._plan(seq_id, num_computed_tokens, num_new_tokens).num_blocks_needed

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
        plan = self._plan(seq_id, num_computed_tokens, num_new_tokens)
        if plan.num_blocks_needed > self.pool.num_free_blocks:
            return False
        fresh = self.pool.allocate(plan.num_blocks_needed)
        table = self._block_tables.setdefault(seq_id, [])
        block_size = self.pool.block_size
        for index, new_block in zip(plan.cow_indices, fresh):
            old_block = table[index]
            table[index] = new_block
            if index * block_size < plan.num_computed_tokens:
                self._pending_copies.append((old_block, new_block))
            # Still referenced by the other sharers (ref_cnt was > 1), so this never frees it.
            self.pool.free([old_block])
        table.extend(fresh[len(plan.cow_indices):])
        return True

    # -- prefix caching --------------------------------------------------------------------------
    #
    # Every full block gets a hash chained from its parent's: block i's hash covers all tokens
    # 0 .. (i+1)*block_size - 1 plus an extra key (a per-tenant cache_salt), so equal hashes mean
    # equal prefixes; a hit is still checked token for token against the block (collisions).
    #
    #   tokens  [The cat sat on | the mat and | then it sl]   block_size 4 (say)
    #   hashes   h0 = H(root, b0)  h1 = H(h0, b1)  (partial: not hashed)

    @staticmethod
    def _root_hash(extra_key: object) -> int:
        return hash(("pagedserve-prefix-root", extra_key))

    def find_cached_prefix(self, token_ids: Sequence[int], extra_key: object = None) -> list[int]:
        """Blocks of the longest cached prefix of full blocks of `token_ids`.

        Capped so at least the last token is left to compute: its logits are needed to sample.
        """
        if not self.enable_prefix_caching:
            return []
        block_size = self.pool.block_size
        parent = self._root_hash(extra_key)
        found: list[int] = []
        for i in range((len(token_ids) - 1) // block_size):
            tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
            block_hash = hash((parent, tokens))
            block_id = self.pool.lookup(block_hash, parent, tokens)
            if block_id is None:
                break
            found.append(block_id)
            parent = block_hash
        return found

    def allocate_with_prefix(self, seq_id: str, cached_blocks: Sequence[int], num_new_tokens: int) -> bool:
        """Start a sequence on cached blocks, then make room for `num_new_tokens` after them.

        All-or-nothing like allocate_slots: on failure the cached blocks are released again.
        """
        self._check_seq_id(seq_id)
        if self._block_tables.get(seq_id):
            raise ValueError(f"sequence {seq_id!r} already has blocks; prefix hits apply to new sequences")
        if not cached_blocks:
            return self.allocate_slots(seq_id, 0, num_new_tokens)
        self.pool.touch(cached_blocks)
        self._block_tables[seq_id] = list(cached_blocks)
        if self.allocate_slots(seq_id, len(cached_blocks) * self.pool.block_size, num_new_tokens):
            return True
        self.free(seq_id)
        return False

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          extra_key: object = None) -> None:
        """Hash the sequence's blocks that became full (all their tokens computed) since the last call."""
        if not self.enable_prefix_caching:
            return
        table = self._block_tables.get(seq_id)
        if table is None:
            return
        block_size = self.pool.block_size
        chain = self._hashes.setdefault(seq_id, [])
        parent = chain[-1] if chain else self._root_hash(extra_key)
        for i in range(len(chain), min(num_computed_tokens // block_size, len(table))):
            tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
            block_hash = hash((parent, tokens))
            self.pool.cache(table[i], block_hash, parent, tokens)
            chain.append(block_hash)
            parent = block_hash

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared (each ref_cnt + 1); nothing is copied.

        Fork between steps, after the parent's K/V for its computed tokens is written: the
        child starts with the parent's ``num_computed_tokens``.
        """
        if parent_id not in self._block_tables:
            raise ValueError(f"fork: unknown parent sequence {parent_id!r}")
        self._check_seq_id(child_id)
        if child_id in self._block_tables:
            raise ValueError(f"fork: child sequence {child_id!r} already has a block table")
        parent_table = self._block_tables[parent_id]
        self.pool.incref(parent_table)
        self._block_tables[child_id] = list(parent_table)
        if parent_id in self._hashes:
            self._hashes[child_id] = list(self._hashes[parent_id])

    def free(self, seq_id: str) -> None:
        """Release the sequence's blocks and forget it; a no-op for an unknown id.

        Tail first: blocks reaching ref_cnt 0 enter the free queue last-block-first, so an LRU
        prefix cache would evict a chain's tail before the prefix other requests may share.
        """
        table = self._block_tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        if table:
            self.pool.free(reversed(table))
            # A copy into a block nobody holds any more is useless; dropping it also keeps
            # the destinations of the pending copies distinct if that block is reused.
            if self._pending_copies:
                self._pending_copies = [
                    (src, dst) for src, dst in self._pending_copies if self.pool.ref_cnt(dst) > 0
                ]

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
        table = self._block_tables.get(seq_id)
        keep = -(-num_tokens // self.pool.block_size)
        if table is None or len(table) <= keep:
            return 0
        dropped = table[keep:]
        del table[keep:]
        chain = self._hashes.get(seq_id)
        if chain is not None and len(chain) > keep:
            del chain[keep:]
        self.pool.free(reversed(dropped))
        if self._pending_copies:
            self._pending_copies = [(src, dst) for src, dst in self._pending_copies if self.pool.ref_cnt(dst) > 0]
        return len(dropped)

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
        for seq_id, table in self._block_tables.items():
            if len(set(table)) != len(table):
                raise BlockPoolIntegrityError(f"block table of {seq_id!r} repeats a block: {table}")
        self.pool.check_integrity(self._block_tables.values())

    def usage(self) -> KVCacheUsage:
        live = {block_id for table in self._block_tables.values() for block_id in table}
        num_shared = sum(1 for block_id in live if self.pool.ref_cnt(block_id) > 1)
        return KVCacheUsage(
            num_blocks=self.pool.num_blocks,
            num_used_blocks=self.pool.num_used_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            num_shared_blocks=num_shared,
            num_exclusive_blocks=len(live) - num_shared,
        )

    def _plan(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> _SlotPlan:
        self._check_seq_id(seq_id)
        _check_count("num_computed_tokens", num_computed_tokens)
        _check_count("num_new_tokens", num_new_tokens)
        table = self._block_tables.get(seq_id, [])
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
                i for i in range(first_written, last_written) if self.pool.ref_cnt(table[i]) > 1
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
