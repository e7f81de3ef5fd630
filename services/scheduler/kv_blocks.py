"""The KV block pool's metadata and the prefix cache over full blocks. The worker owns the tensors.

A full block is identified by a chained hash of its tokens and its parent block's hash,
so equal hashes mean equal prefixes; the stored tokens are compared on every hit, so a
hash collision is a miss, never wrong output. Blocks are reference-counted: a block
is free (on the free list), held (refcount > 0), or cached and idle (refcount 0, in the
LRU, reusable by a later hit or evicted when the free list runs dry).

A hybrid model's cache (``state_slots.CheckpointPool``) listens: ``on_evict`` hears every hash that
leaves the cache, and ``retains`` says whether an idle block is worth keeping (one that no GDN state
checkpoint's prefix covers goes to the front of the LRU, as ``demote`` sends one that stopped being covered).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class _CachedBlock:
    parent: int | None  # the previous block's hash, None for a prompt's first block
    tokens: tuple[int, ...]
    block: int


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks
        self._by_hash: dict[int, _CachedBlock] = {}
        self._hash_of: dict[int, int] = {}  # block -> its hash, for cached blocks
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks with refcount 0, least recent first
        self.queries = 0  # prompt tokens looked up at admissions
        self.hits = 0  # of which were found in the cache
        self.on_evict: Callable[[int], None] | None = None  # hears each hash that leaves the cache
        self.retains: Callable[[int], bool] | None = None  # whether an idle cached block keeps its place in the LRU

    # Capacity. ------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and idle cached ones (evicted on demand)."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # Allocation. ----------------------------------------------------------------------

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks (evicting idle cached ones if needed), or None and nothing taken."""
        if count > self.num_free:
            return None
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._idle.popitem(last=False)
                self._uncache(block)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drops one reference to each block; unreferenced cached blocks stay reusable until evicted."""
        for block in reversed(blocks):  # the tail first, so a prefix outlives its continuations in the LRU
            refs = self._refs[block] - 1
            if refs < 0:
                raise RuntimeError(f"block {block} freed more often than it was taken")
            self._refs[block] = refs
            if refs == 0:
                if block in self._hash_of:
                    self._idle[block] = None
                    if self.retains is not None and not self.retains(self._hash_of[block]):
                        self._idle.move_to_end(block, last=False)
                else:
                    self._free.append(block)

    # Prefix cache. --------------------------------------------------------------------

    def block_hash(self, parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def match_prefix(self, token_ids: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
        """The cached blocks (and their hashes) that start ``token_ids``, covering at most ``max_tokens``.

        The returned blocks are taken: their reference counts are incremented.
        """
        blocks, hashes = self.walk(token_ids, max_tokens)
        self.take(blocks)
        return blocks, hashes

    def walk(self, token_ids: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
        """What ``match_prefix`` finds, taking nothing."""
        if not self.enable_prefix_cache:
            return [], []
        blocks: list[int] = []
        hashes: list[int] = []
        parent: int | None = None
        size = self.block_size
        for start in range(0, max_tokens - size + 1, size):
            tokens = tuple(token_ids[start : start + size])
            key = self.block_hash(parent, tokens)
            entry = self._by_hash.get(key)
            if entry is None or entry.tokens != tokens or entry.parent != parent:
                break
            blocks.append(entry.block)
            hashes.append(key)
            parent = key
        return blocks, hashes

    def take(self, blocks: list[int]) -> None:
        """One more reference to each of these cached blocks (found by ``walk``)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._idle[block]
            self._refs[block] += 1

    def is_cached(self, key: int) -> bool:
        return key in self._by_hash

    def demote(self, key: int) -> None:
        """Moves the block cached under ``key``, if idle, to the front of the LRU: it goes first."""
        entry = self._by_hash.get(key)
        if entry is not None and entry.block in self._idle:
            self._idle.move_to_end(entry.block, last=False)

    def count_lookup(self, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit

    def forget(self, blocks: list[int]) -> None:
        """Removes these blocks from the prefix cache (their contents can't be trusted)."""
        for block in blocks:
            if block in self._hash_of:
                self._uncache(block)
                if block in self._idle:
                    del self._idle[block]
                    self._free.append(block)

    def clear(self) -> None:
        """Empties the prefix cache (the worker that held its KV is gone); held blocks stay held."""
        for block in list(self._hash_of):
            self._uncache(block)
        self._free.extend(self._idle)
        self._idle.clear()

    def _uncache(self, block: int) -> None:
        key = self._hash_of.pop(block)
        del self._by_hash[key]
        if self.on_evict is not None:
            self.on_evict(key)

    def register(self, block: int, parent: int | None, tokens: tuple[int, ...]) -> int:
        """Records a full, computed (or scheduled) block under its chained hash; returns the hash."""
        key = self.block_hash(parent, tokens)
        if self.enable_prefix_cache and key not in self._by_hash and block not in self._hash_of:
            self._by_hash[key] = _CachedBlock(parent, tokens, block)
            self._hash_of[block] = key
        return key

    def check(self) -> None:
        """Asserts the pool's invariants (for tests): every block is exactly one of free, held or idle-cached."""
        free, idle = set(self._free), set(self._idle)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & idle, "a block is both free and cached"
        for block, refs in enumerate(self._refs):
            assert refs >= 0
            assert (block in free) + (block in idle) + (refs > 0) == 1, f"block {block}: free={block in free} idle={block in idle} refs={refs}"
        assert set(self._hash_of) == {e.block for e in self._by_hash.values()}
        assert idle <= set(self._hash_of)
