"""Prefix caching for the KV cache manager: block hashes, the longest cached prefix, starting a sequence on it.

Every full block gets a hash chained from its parent's: block i's hash covers all tokens
0 .. (i+1)*block_size - 1 plus an extra key (prefix_key: a per-tenant cache_salt, and LongRoPE's long-prompt
flag), so equal hashes mean equal prefixes; a hit is still checked token for token against the block::

    tokens  [The cat sat on | the mat and | then it sl]   block_size 4 (say)
    hashes   h0 = H(root, b0)  h1 = H(h0, b1)  (partial: not hashed)

With KV cache groups (kv_cache_groups.py) each group chains from its own root, and a hit is the longest
prefix every group can serve: a global group needs all of its blocks, a sliding group only those its window
needs (vLLM's hybrid rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .block_pool import BlockPool


class CachedPrefix(list):
    """find_cached_prefix's answer: the hit's blocks of group 0 (the list itself: its length is the hit in
    blocks) and `group_blocks`, the hit's blocks of every group (a sliding group's entries that its window
    does not need are the null block)."""

    group_blocks: tuple[list[int], ...] = ()


class PrefixCaching:
    """KVCacheManager's prefix-caching half (a base class of it): it reads the manager's pool, groups, tables
    and per-sequence hash chains, and calls its allocate_slots / free."""

    pool: BlockPool
    enable_prefix_caching: bool
    long_prompt_threshold: int | None
    group_windows: tuple[int | None, ...]
    null_block: int | None
    _tables: dict[str, list[list[int]]]
    _hashes: dict[str, list[list[int]]]

    def prefix_key(self, cache_salt: str | None, num_prompt_tokens: int, lora_key: object = None) -> object:
        """The extra key a request's block hashes are rooted in: its cache_salt, and for a LongRoPE model also
        whether its prompt is longer than the threshold M (vLLM's extra keys of a block hash).

        Why that flag suffices: a token at position p of a request with a prompt of P tokens is rotated long
        iff P > M or p >= M (models/rope.py). Among requests of one flag that is a function of p alone (True:
        always long; False: long from p = M on, so a short prompt, whose hits all sit at positions < P <= M,
        only ever reads keys rotated short), and a chained hash fixes its block's positions: equal hashes mean
        equal keys. Without LongRoPE the key is the salt alone, so hashes are unchanged.
        lora_key: the request's LoRA adapter (LoRARequest.cache_key): two adapters never share KV."""
        if lora_key is not None:
            return (self.prefix_key(cache_salt, num_prompt_tokens), lora_key)
        if self.long_prompt_threshold is None:
            return cache_salt
        return (cache_salt, num_prompt_tokens > self.long_prompt_threshold)

    @staticmethod
    def _root_hash(extra_key: object, group: int = 0) -> int:
        # Each group chains from its own root: equal tokens in two groups are two blocks (other layers' K/V).
        if group == 0:
            return hash(("pagedserve-prefix-root", extra_key))
        return hash(("pagedserve-prefix-root", extra_key, group))

    def _first_needed(self, group: int, num_blocks: int) -> int:
        """The first of a hit's `num_blocks` blocks that group needs: all for a global group; for a sliding
        one those holding the window of the first uncomputed position (num_blocks * block_size)."""
        window = self.group_windows[group]
        if window is None:
            return 0
        return max(0, num_blocks * self.pool.block_size - window + 1) // self.pool.block_size

    def find_cached_prefix(self, token_ids: Sequence[int], extra_key: object = None) -> CachedPrefix:
        """Blocks of the longest cached prefix of full blocks of `token_ids` that every group can serve: a
        global group needs all of the prefix's blocks cached, a sliding group only those its window needs
        (vLLM's hybrid rule); a block some group misses inside what it needs cuts the hit back to it.

        Capped so at least the last token is left to compute: its logits are needed to sample.
        """
        hit = CachedPrefix()
        hit.group_blocks = tuple([] for _ in self.group_windows)
        if not self.enable_prefix_caching:
            return hit
        block_size = self.pool.block_size
        limit = (len(token_ids) - 1) // block_size
        hashes, parents = [], []  # per group: the chain's hash of each block and its parent's
        for g in range(self.num_groups):
            parent, chain, links = self._root_hash(extra_key, g), [], []
            for i in range(limit):
                links.append(parent)
                parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
                chain.append(parent)
            hashes.append(chain)
            parents.append(links)

        def lookup(g: int, i: int) -> int | None:
            return self.pool.lookup(hashes[g][i], parents[g][i],
                                    tuple(token_ids[i * block_size : (i + 1) * block_size]))

        found: list[dict[int, int]] = [{} for _ in self.group_windows]
        n = limit
        for g, window in enumerate(self.group_windows):  # global groups: the longest prefix, left to right
            if window is None:
                for i in range(n):
                    block = lookup(g, i)
                    if block is None:
                        n = i
                        break
                    found[g][i] = block
        settled = False
        while n > 0 and not settled:  # sliding groups: cut back until each holds its window of the hit
            settled = True
            for g, window in enumerate(self.group_windows):
                if window is None:
                    continue
                for i in range(n - 1, self._first_needed(g, n) - 1, -1):
                    block = found[g].get(i)
                    if block is None:
                        block = lookup(g, i)
                    if block is None:
                        n, settled = i, False
                        break
                    found[g][i] = block
                if not settled:
                    break
        null = self.null_block
        hit.group_blocks = tuple(
            [found[g][i] if i >= self._first_needed(g, n) else null for i in range(n)]  # type: ignore[misc]
            for g in range(self.num_groups))
        hit.extend(hit.group_blocks[0])
        return hit

    def allocate_with_prefix(self, seq_id: str, cached_blocks: Sequence[int], num_new_tokens: int) -> bool:
        """Start a sequence on cached blocks (find_cached_prefix's answer; a plain list of blocks with one
        global group), then make room for `num_new_tokens` after them.

        All-or-nothing like allocate_slots: on failure the cached blocks are released again.
        """
        self._check_seq_id(seq_id)
        if any(self._tables.get(seq_id, ())):
            raise ValueError(f"sequence {seq_id!r} already has blocks; prefix hits apply to new sequences")
        if not cached_blocks:
            return self.allocate_slots(seq_id, 0, num_new_tokens)
        groups = getattr(cached_blocks, "group_blocks", ())
        if not groups:
            if self.num_groups != 1:
                raise ValueError("allocate_with_prefix: give find_cached_prefix's answer (blocks of every group)")
            groups = (list(cached_blocks),)
        if len(groups) != self.num_groups or any(len(t) != len(cached_blocks) for t in groups):
            raise ValueError("allocate_with_prefix: the cached blocks do not match this manager's groups")
        for table in groups:
            self.pool.touch(self._live(table))
        self._tables[seq_id] = [list(t) for t in groups]
        if self.allocate_slots(seq_id, len(cached_blocks) * self.pool.block_size, num_new_tokens):
            return True
        self.free(seq_id)
        return False

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          extra_key: object = None) -> None:
        """Hash the sequence's blocks that became full (all their tokens computed) since the last call; a
        sliding group's released entries are chained over but not cached (their block is gone)."""
        if not self.enable_prefix_caching:
            return
        tables = self._tables.get(seq_id)
        if tables is None:
            return
        block_size = self.pool.block_size
        chains = self._hashes.setdefault(seq_id, [[] for _ in tables])
        for g, (table, chain) in enumerate(zip(tables, chains)):
            parent = chain[-1] if chain else self._root_hash(extra_key, g)
            for i in range(len(chain), min(num_computed_tokens // block_size, len(table))):
                tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
                block_hash = hash((parent, tokens))
                if table[i] != self.null_block:
                    self.pool.cache(table[i], block_hash, parent, tokens)
                chain.append(block_hash)
                parent = block_hash
