"""GDN state slots' metadata: which running request holds which slot, and which checkpoint slot holds the
state after which cached prefix (``CheckpointPool``). The worker owns the tensors.

A hybrid model's request holds one slot from admission until it finishes, is aborted or is
preempted (recomputation starts over in whatever slot it gets next). The worker starts a request's
first chunk from a zero state, so a slot needs no clearing between holders.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass


class SlotPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"a hybrid model needs at least one GDN state slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out low ids first
        self._held = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int | None:
        """A free slot, or None when every slot is held."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._held[slot] = True
        return slot

    def free(self, slot: int) -> None:
        if not self._held[slot]:
            raise RuntimeError(f"GDN state slot {slot} freed but not held")
        self._held[slot] = False
        self._free.append(slot)

    def check(self) -> None:
        """Asserts the pool's invariants (for tests): every slot is exactly one of free or held."""
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is on the free list twice"
        for slot, held in enumerate(self._held):
            assert held != (slot in free), f"slot {slot}: held={held} free={slot in free}"


@dataclass(frozen=True)
class Checkpoint:
    slot: int
    position: int  # the prefix it holds the GDN state after: whole blocks, ``len(chain)`` of them
    chain: tuple[int, ...]  # the chained hashes of the prefix's blocks; the last one keys the checkpoint
    step: int  # the plan whose slice saves it: only later plans may restore it
    owner: str  # the request that saves it


class CheckpointPool:
    """GDN state checkpoints of a hybrid model's prefix cache: which checkpoint slot holds the state after which
    cached prefix. The worker owns the tensors (a pool apart from the running requests' slots).

    A checkpoint lives only while every block of its prefix is cached (``dropped_with`` hears each hash that
    leaves the KV cache); a restore copies it into the request's own slot, so running requests never share
    one. When the pool is full the least recently saved or restored checkpoint not saved by the current plan
    makes room, an interior one first (a longer checkpoint extends its prefix): a follow-up turn resumes at a
    conversation's deepest checkpoint, so concurrent conversations keep their ends rather than their interval
    checkpoints, and a shared system prompt's stays while its hits keep it recent. The KV blocks that no
    checkpoint covers any more go to the front of the KV cache's LRU (``on_uncovered``), as a hybrid prefix
    without a checkpoint at its end cannot be resumed.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"a hybrid model's prefix cache needs at least one GDN checkpoint slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._by_key: OrderedDict[int, Checkpoint] = OrderedDict()  # least recently used first
        self._covering: dict[int, set[int]] = {}  # block hash -> keys of the checkpoints whose prefix holds it
        self.on_uncovered: Callable[[int], None] | None = None
        self.saved = 0
        self.restored = 0  # restores at admission: the gdn_checkpoints_used metric

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[Checkpoint]:
        return iter(self._by_key.values())

    def covers(self, key: int) -> bool:
        """Whether some checkpoint's prefix holds the block hashed ``key``."""
        return key in self._covering

    def longest(self, hashes: list[int], step: int) -> Checkpoint | None:
        """The checkpoint at the end of the longest prefix of ``hashes`` that a plan of ``step`` may restore."""
        for n in range(len(hashes), 0, -1):
            checkpoint = self._by_key.get(hashes[n - 1])
            if checkpoint is not None and checkpoint.step < step:
                return checkpoint
        return None

    def touch(self, checkpoint: Checkpoint) -> None:
        """Makes the checkpoint the most recently used (an admission restores it)."""
        if checkpoint.chain[-1] in self._by_key:
            self._by_key.move_to_end(checkpoint.chain[-1])

    def save(self, chain: tuple[int, ...], position: int, step: int, owner: str) -> int | None:
        """A slot for the state after ``chain``, or None when one holds it already or every slot is this plan's."""
        key = chain[-1]
        if key in self._by_key:
            return None
        if not self._free:
            victim = self._victim(step)
            if victim is None:
                return None
            self._drop(victim)
        slot = self._free.pop()
        self._by_key[key] = Checkpoint(slot, position, chain, step, owner)
        for h in chain:
            self._covering.setdefault(h, set()).add(key)
        self.saved += 1
        return slot

    def _victim(self, step: int) -> Checkpoint | None:
        """The checkpoint that makes room for a save by a plan of ``step``: the least recently used interior one
        (another checkpoint's prefix holds its last block), else the least recently used; never one of this plan's."""
        oldest = None
        for key, checkpoint in self._by_key.items():
            if checkpoint.step >= step:
                continue
            if len(self._covering[key]) > 1:
                return checkpoint
            oldest = oldest or checkpoint
        return oldest

    def dropped_with(self, key: int) -> None:
        """The block hashed ``key`` left the KV cache: every checkpoint whose prefix holds it goes."""
        for covering in list(self._covering.get(key, ())):
            self._drop(self._by_key[covering])

    def drop_owned(self, rids: set[str]) -> None:
        """Drops the checkpoints these requests save (their step failed: the state may not have been written)."""
        for checkpoint in [c for c in self._by_key.values() if c.owner in rids]:
            self._drop(checkpoint)

    def clear(self) -> None:
        for checkpoint in list(self._by_key.values()):
            self._drop(checkpoint)

    def _drop(self, checkpoint: Checkpoint) -> None:
        key = checkpoint.chain[-1]
        del self._by_key[key]
        self._free.append(checkpoint.slot)
        for h in checkpoint.chain:
            covering = self._covering[h]
            covering.discard(key)
            if not covering:
                del self._covering[h]
                if self.on_uncovered is not None:
                    self.on_uncovered(h)

    def check(self) -> None:
        """Asserts the pool's invariants (for tests): at most ``num_slots`` checkpoints, each in its own slot."""
        slots = [c.slot for c in self._by_key.values()]
        assert len(slots) + len(self._free) == self.num_slots, "a checkpoint slot is lost or counted twice"
        assert not set(slots) & set(self._free) and len(set(slots)) == len(slots), "a checkpoint slot is held twice"
        covering: dict[int, set[int]] = {}
        for key, c in self._by_key.items():
            assert key == c.chain[-1]
            for h in c.chain:
                covering.setdefault(h, set()).add(key)
        assert covering == self._covering
