"""The block pool: a fixed set of KV cache blocks, their ref counts and the free queue.

The KV cache of every layer is an array ``[num_blocks, block_size, num_kv_heads, head_dim]``;
this module never touches it. It only hands out block *ids* (plain ints ``0..num_blocks-1``)
and keeps, per block, how many block tables point at it::

    block id     0     1     2     3     4     5     6     7
    ref_cnt      1     2     0     1     0     0     1     0
                 used  shared free used  free  free  used  free

    free queue:  HEAD <-> 2 <-> 5 <-> 4 <-> 7 <-> TAIL
                 allocate() pops here       free() appends here

Every block is either *used* (``ref_cnt > 0``, in no queue) or *free* (``ref_cnt == 0``,
in the free queue exactly once). ``allocate`` takes blocks from the head, ``free`` puts a
block whose count drops to zero at the tail, so the queue is in least-recently-freed order.

Why a doubly linked list and not a deque or a set: prefix caching keeps a freed block's hash, so
a free block may still hold reusable K/V. A cache hit then has to
take that block out of the *middle* of the queue ("touch"), and eviction must take the
least recently freed first. Links stored on the blocks themselves make both O(1):
``FreeKVBlockQueue.remove`` is that touch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field


class BlockPoolIntegrityError(AssertionError):
    """The pool's bookkeeping disagrees with the block tables (a bug, never bad user input)."""


class NoFreeBlocksError(RuntimeError):
    """``allocate(n)`` was asked for more blocks than are free; check ``num_free_blocks`` first."""


@dataclass(eq=False, slots=True)
class KVBlock:
    """Metadata of one KV cache block. Identity matters (eq=False): the queue links to objects."""

    block_id: int
    ref_cnt: int = 0
    # Prefix caching: a full block's chained hash, its parent's hash and its token ids (kept to
    # check a hash hit token for token). They survive free(): a free block with a hash is a
    # cached block, reusable until allocate() evicts it.
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    # Free-queue links; both are None exactly when the block is not in the queue.
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)

    @property
    def is_in_free_queue(self) -> bool:
        return self.prev_free is not None


class FreeKVBlockQueue:
    """Intrusive doubly linked list of free blocks with two sentinels.

    ::

        head <-> b2 <-> b5 <-> b4 <-> tail      (sentinels have block_id -1)

    The sentinels mean no operation special-cases an empty list or an end node, and a block
    is in the queue exactly when its ``prev_free`` is set, which gives an O(1) membership test.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None, "free queue link broken"
            yield node
            node = node.next_free

    def append(self, block: KVBlock) -> None:
        """Put ``block`` at the tail (it will be the last to be reused)."""
        assert not block.is_in_free_queue, f"block {block.block_id} is already in the free queue"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def popleft(self) -> KVBlock:
        """Take the least recently freed block."""
        first = self._head.next_free
        if first is self._tail or first is None:
            raise NoFreeBlocksError("the free block queue is empty")
        self.remove(first)
        return first

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from wherever it sits in the queue, in O(1)."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, (
            f"block {block.block_id} is not in the free queue"
        )
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = None
        block.next_free = None
        self._len -= 1

    def block_ids(self) -> list[int]:
        return [block.block_id for block in self]

    def check_links(self, max_len: int) -> list[KVBlock]:
        """Walk the list checking every back link; returns the blocks in queue order.

        Bounded by ``max_len`` so a corrupted (cyclic) list raises instead of looping forever.
        """
        blocks: list[KVBlock] = []
        prev = self._head
        node = self._head.next_free
        while node is not self._tail:
            if node is None:
                raise BlockPoolIntegrityError(f"free queue broken after block {prev.block_id}")
            if node.prev_free is not prev:
                raise BlockPoolIntegrityError(
                    f"free queue back link of block {node.block_id} does not point at "
                    f"block {prev.block_id}"
                )
            blocks.append(node)
            if len(blocks) > max_len:
                raise BlockPoolIntegrityError(f"free queue longer than {max_len} (a cycle?)")
            prev, node = node, node.next_free
        if self._tail.prev_free is not prev:
            raise BlockPoolIntegrityError("free queue tail sentinel is not linked to the last one")
        if len(blocks) != self._len:
            raise BlockPoolIntegrityError(
                f"free queue holds {len(blocks)} blocks but its length counter says {self._len}"
            )
        return blocks


class BlockPool:
    """A fixed pool of ``num_blocks`` KV blocks of ``block_size`` token slots each.

    ``allocate`` / ``incref`` / ``free`` are O(1) per block. The pool trusts no caller with
    its counts: freeing a free block (a double free) raises before anything changes.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        # Initially in id order, so a fresh pool hands out 0, 1, 2, ... (handy in tests and logs).
        self._free_queue = FreeKVBlockQueue(self._blocks)
        self._cached: dict[int, KVBlock] = {}  # block_hash -> the block holding that content
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free_queue)

    def ref_cnt(self, block_id: int) -> int:
        return self._block(block_id).ref_cnt

    def free_block_ids(self) -> list[int]:
        """The free queue in order, next to be allocated first. O(num_free): tests and debugging."""
        return self._free_queue.block_ids()

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue; each gets ``ref_cnt == 1``."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"number of blocks to allocate must be a non-negative int, got {n!r}")
        if n > len(self._free_queue):
            raise NoFreeBlocksError(
                f"cannot allocate {n} blocks: only {len(self._free_queue)} of "
                f"{self._num_blocks} are free"
            )
        block_ids = []
        for _ in range(n):
            block = self._free_queue.popleft()
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue has refs"
            if block.block_hash is not None:  # evict: least recently freed cached block first
                self._uncache(block)
                self.num_evictions += 1
            block.ref_cnt = 1
            block_ids.append(block.block_id)
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (sharing it with one more block table).

        Only blocks in use can be shared: a free block's contents are not owned by anyone.
        (``touch`` is the way to revive a cached free block.)
        """
        blocks = [self._block(block_id) for block_id in block_ids]
        for block in blocks:
            if block.ref_cnt == 0:
                raise ValueError(f"cannot incref block {block.block_id}: it is free")
        for block in blocks:
            block.ref_cnt += 1

    # -- prefix caching ------------------------------------------------------------------------

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> int | None:
        """The block caching exactly this content (same chain and same tokens), else None."""
        block = self._cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None  # absent, or a hash collision caught by the token check
        return block.block_id

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to cached blocks, reviving free ones out of the free queue (O(1))."""
        for block in [self._block(block_id) for block_id in block_ids]:
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    raise ValueError(f"cannot touch block {block.block_id}: it is free and caches nothing")
                self._free_queue.remove(block)
            block.ref_cnt += 1

    def cache(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> bool:
        """Record that a used, full block holds this content; False if it (or an equal block) already does."""
        block = self._block(block_id)
        if block.ref_cnt == 0:
            raise ValueError(f"cannot cache free block {block_id}")
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached[block_hash] = block
        return True

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def _uncache(self, block: KVBlock) -> None:
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = block.parent_hash = block.token_ids = None

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order.

        A block whose count reaches zero goes to the tail of the free queue, so the order of
        ``block_ids`` is the order of later reuse (eviction order, once blocks are cached).
        All ids are checked first: on a double free nothing changes and ValueError is raised.
        """
        blocks = [self._block(block_id) for block_id in block_ids]
        drops = Counter(block.block_id for block in blocks)
        for block_id, n in drops.items():
            have = self._blocks[block_id].ref_cnt
            if n > have:
                raise ValueError(
                    f"double free of block {block_id}: freeing {n} reference(s) but it has {have}"
                )
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue.append(block)

    def check_integrity(self, block_tables: Iterable[Sequence[int]]) -> None:
        """Check the pool against *all* live block tables; raise BlockPoolIntegrityError if off.

        Holds when: each block's ref_cnt equals the number of times it appears in the tables;
        each block with ref_cnt 0 is in the free queue exactly once; each block with
        ref_cnt > 0 is not in it; the queue's links and length counter agree. Together these
        mean no block is lost: free + used == num_blocks. O(num_blocks + table entries).
        """
        refs = [0] * self._num_blocks
        for table in block_tables:
            for block_id in table:
                if not isinstance(block_id, int) or not 0 <= block_id < self._num_blocks:
                    raise BlockPoolIntegrityError(
                        f"block table entry {block_id!r} is not a block id "
                        f"in [0, {self._num_blocks})"
                    )
                refs[block_id] += 1
        queued = [0] * self._num_blocks
        for block in self._free_queue.check_links(max_len=self._num_blocks):
            i = block.block_id
            if not 0 <= i < self._num_blocks or self._blocks[i] is not block:
                raise BlockPoolIntegrityError(f"free queue holds a foreign block {block!r}")
            queued[i] += 1
        for block in self._blocks:
            i = block.block_id
            if block.ref_cnt != refs[i]:
                raise BlockPoolIntegrityError(
                    f"block {i} has ref_cnt {block.ref_cnt} but appears {refs[i]} time(s) "
                    "in the block tables"
                )
            if block.ref_cnt == 0 and queued[i] != 1:
                raise BlockPoolIntegrityError(
                    f"free block {i} is in the free queue {queued[i]} time(s), expected once"
                )
            if block.ref_cnt > 0 and queued[i] != 0:
                raise BlockPoolIntegrityError(
                    f"used block {i} (ref_cnt {block.ref_cnt}) is in the free queue"
                )
            if block.is_in_free_queue != (queued[i] == 1):
                raise BlockPoolIntegrityError(f"block {i} has stale free-queue links")
        if self.num_free_blocks + sum(1 for r in refs if r > 0) != self._num_blocks:
            raise BlockPoolIntegrityError("free + used blocks do not add up to num_blocks")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash or self._blocks[block.block_id] is not block:
                raise BlockPoolIntegrityError(f"prefix cache maps hash {block_hash} to block {block.block_id}, "
                                              f"which holds hash {block.block_hash}")

    def _block(self, block_id: int) -> KVBlock:
        if not isinstance(block_id, int) or isinstance(block_id, bool):
            raise ValueError(f"block id must be an int, got {block_id!r}")
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} is out of range [0, {self._num_blocks})")
        return self._blocks[block_id]
