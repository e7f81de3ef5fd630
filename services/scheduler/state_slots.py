"""GDN state slots' metadata: which running request holds which slot. The worker owns the tensors.

A hybrid model's request holds one slot from admission until it finishes, is aborted or is
preempted (recomputation starts over in whatever slot it gets next). The worker starts a request's
first chunk from a zero state, so a slot needs no clearing between holders.
"""

from __future__ import annotations


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
