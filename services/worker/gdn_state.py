"""Gated DeltaNet state slots on the worker: the tensors, and one step's view of which slot each slice uses.

A slot holds one request's whole GDN state: per GDN layer, the conv1d history (the last ``K − 1``
inputs, in the model dtype) and the recurrent state (fp32). The scheduler hands slots out and takes
them back; the worker never clears one: a request's first chunk reads zeros instead of its slot
(``has_initial_state`` False), so a slot reused after an abort or a preemption starts clean. With
decode graphs, the worker's pool has one slot more than the scheduler hands out: the dummy slot of
graph padding rows, which is zeroed on every replay.

A hybrid model's prefix cache keeps checkpoints in the same tensors, past the running slots: a prefill
chunk copies its slot's state into a checkpoint at the positions its slice names (the chunk runs in
rounds cut there: ``SlotMetadata.by_rounds``), and a request that resumes a cached prefix starts from a
copy of the checkpoint in its own slot (``GDNStateCache.restore_``).

Speculative decoding rolls the state back past rejected tokens by keeping the state after every position
of a verify, as vLLM does. A verify slice (its last token and k proposed ones) runs its GDN layers token
by token, with the decode kernels (``SlotMetadata.by_positions``: position t of every verify in one call);
after each position but its last, its slot's state is copied into a verify state, the pool's entries past
the checkpoints (``speculative_max_batch × k`` of them, reused by every step). Once the verifier has
chosen, a verify that accepted ``a`` of its proposals copies the state after its position ``a`` back into
its slot (``SlotMetadata.keep_accepted``); one that accepted all of them is there already. A rejected
token thus costs a copy of the state, not a recomputation, and the prefill chunks beside the verifies run
the chunked kernels as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


class GDNShape(NamedTuple):
    """What a hybrid model needs per slot."""

    num_layers: int  # GDN layers
    conv_channels: int  # 2·Hk·Dk + Hv·Dv: q, k and v go through the conv together
    conv_history: int  # K − 1
    num_v_heads: int
    key_dim: int
    value_dim: int


class GDNStateCache:
    """``conv[i]`` [S, C, K − 1] and ``recurrent[i]`` [S, Hv, Dk, Dv] fp32 of GDN layer i, where S is
    ``num_slots`` running slots, then ``num_checkpoints`` checkpoints (checkpoint c is index ``checkpoint_base + c``),
    then ``num_verify_states`` states a step's verifies save to roll back to (from ``verify_base`` on)."""

    def __init__(
        self,
        shape: GDNShape,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_checkpoints: int = 0,
        num_verify_states: int = 0,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"a hybrid model needs at least one state slot, got {num_slots}")
        self.shape, self.num_slots, self.num_checkpoints, self.num_verify_states = shape, num_slots, num_checkpoints, num_verify_states
        self.checkpoint_base = num_slots
        self.verify_base = num_slots + num_checkpoints
        total = num_slots + num_checkpoints + num_verify_states
        self.conv_tensor = torch.zeros(shape.num_layers, total, shape.conv_channels, shape.conv_history, dtype=dtype, device=device)
        self.recurrent_tensor = torch.zeros(shape.num_layers, total, shape.num_v_heads, shape.key_dim, shape.value_dim, dtype=torch.float32, device=device)
        self.conv, self.recurrent = list(self.conv_tensor.unbind(0)), list(self.recurrent_tensor.unbind(0))

    @property
    def nbytes(self) -> int:
        """The running slots' bytes."""
        return self.bytes_per_slot * self.num_slots

    @property
    def checkpoint_bytes(self) -> int:
        return self.bytes_per_slot * self.num_checkpoints

    @property
    def verify_state_bytes(self) -> int:
        return self.bytes_per_slot * self.num_verify_states

    @property
    def bytes_per_slot(self) -> int:
        return sum(t[:, 0].numel() * t.element_size() for t in (self.conv_tensor, self.recurrent_tensor))

    def restore_(self, checkpoint: int, slot: int) -> None:
        """Copy checkpoint ``checkpoint``'s state, every layer's, into running slot ``slot``."""
        self.copy_(self.checkpoint_base + checkpoint, slot)

    def copy_(self, src: int, dst: int) -> None:
        """Copy pool entry ``src``'s state, every layer's, into entry ``dst``."""
        self.conv_tensor[:, dst] = self.conv_tensor[:, src]
        self.recurrent_tensor[:, dst] = self.recurrent_tensor[:, src]

    def check_verifies(self, positions: int) -> None:
        """A ``ValueError`` unless a step's verifies, ``positions`` positions past their first in all, fit the verify states."""
        if positions > self.num_verify_states:
            raise ValueError(
                f"a step verifies {positions} proposed tokens of a hybrid model but its GDN pool keeps {self.num_verify_states} states to roll back to"
            )

    def zero_slot_(self, slot: int) -> None:
        """Clear one slot's state in every layer (two kernels, no host sync: it may run inside a graph)."""
        self.conv_tensor[:, slot].zero_()
        self.recurrent_tensor[:, slot].zero_()


@dataclass(frozen=True)
class Round:
    """One varlen call over some prefill rows (those of each chunk's next piece), then the checkpoints it ends at."""

    rows: torch.Tensor  # [n] int64, counted from the first prefill row
    cu_seqlens: torch.Tensor  # [P' + 1] int32
    slots: torch.Tensor  # [P'] int32
    has_initial_state: torch.Tensor  # [P'] bool
    save_from: torch.Tensor  # [s] int64: running slots whose state is copied ...
    save_to: torch.Tensor  # [s] int64: ... into these pool indices (checkpoints)


def _rounds(slots: list[int], starts: list[int], lens: list[int], saves: list[list[tuple[int, int]]], base: int) -> list[tuple]:
    """The prefill chunks cut at their checkpoint positions: round r runs every chunk's r-th piece."""
    pieces = []  # per chunk: [(first row, length, saves at its end)]
    row = 0
    for start, n, chunk_saves in zip(starts, lens, saves):
        cuts = sorted({p - start for p, _ in chunk_saves})
        bounds = [0, *cuts] if cuts and cuts[-1] == n else [0, *cuts, n]
        at = {p - start: [] for p, _ in chunk_saves}
        for p, c in chunk_saves:
            at[p - start].append(base + c)
        pieces.append([(row + a, b - a, at.get(b, [])) for a, b in zip(bounds, bounds[1:])])
        row += n
    rounds = []
    for r in range(max(len(p) for p in pieces)):
        rows, cu, ids, initial, save_from, save_to = [], [0], [], [], [], []
        for b, chunk in enumerate(pieces):
            if r >= len(chunk):
                continue
            first, n, to = chunk[r]
            rows.extend(range(first, first + n))
            cu.append(cu[-1] + n)
            ids.append(slots[b])
            initial.append(r > 0 or starts[b] > 0)
            save_from.extend([slots[b]] * len(to))
            save_to.extend(to)
        rounds.append((rows, cu, ids, initial, save_from, save_to))
    return rounds


@dataclass(frozen=True)
class Position:
    """One decode-kernel call over the verifies: position t of each verify that long, then the states it saves."""

    rows: torch.Tensor  # [n] int64, counted from the first verify row
    slots: torch.Tensor  # [n] int32
    save_from: torch.Tensor  # [s] int64: the slots of the verifies that go on past position t ...
    save_to: torch.Tensor  # [s] int64: ... copied into these verify states


def _positions(slots: list[int], lens: list[int], base: int) -> tuple[list[tuple], list[list[int]]]:
    """The verifies position by position, and per verify the pool index of its state after each position but its last."""
    firsts = [0, *itertools.accumulate(lens)][:-1]
    saved = [list(range(base + first - b, base + first - b + n - 1)) for b, (first, n) in enumerate(zip(firsts, lens))]
    made = []
    for t in range(max(lens)):
        going = [b for b, n in enumerate(lens) if t < n]
        on = [b for b in going if t < lens[b] - 1]
        made.append(([firsts[b] + t for b in going], [slots[b] for b in going], [slots[b] for b in on], [saved[b][t] for b in on]))
    return made, saved


@dataclass(frozen=True)
class SlotMetadata:
    """One step's slots, in flat-batch order: ``num_decodes`` decode slices (one token each), then ``len(verify_slots)``
    verifies (a decode's token and its proposed tokens: ``num_verify_rows`` rows in all), then prefill chunks.

    ``prefill_cu_seqlens`` delimits the prefill chunks' rows, counted from the first prefill row.
    """

    cache: GDNStateCache
    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] int32
    prefill_slots: torch.Tensor  # [P] int32
    prefill_cu_seqlens: torch.Tensor  # [P + 1] int32
    prefill_has_initial_state: torch.Tensor  # [P] bool: the chunk continues a prefill (start > 0)
    prefill_rounds: tuple[Round, ...] | None = None  # where a chunk saves checkpoints: its pieces, round by round
    num_verify_rows: int = 0
    verify_positions: tuple[Position, ...] = ()
    verify_slots: tuple[int, ...] = ()
    verify_saved: tuple[tuple[int, ...], ...] = ()  # per verify: the pool index of its state after each position but its last

    @classmethod
    def build(
        cls,
        cache: GDNStateCache,
        slots: list[int],
        starts: list[int],
        lens: list[int],
        num_decodes: int,
        saves: list[list[tuple[int, int]]] | None = None,
        num_verifies: int = 0,
    ) -> SlotMetadata:
        """Built on the CPU, then moved to the device the state lives on (where the kernels read it). ``saves``: per
        prefill chunk, the (position, checkpoint) pairs it saves; the ``num_verifies`` slices after the decodes are verifies."""
        first_prefill = num_decodes + num_verifies
        prefill_lens = lens[first_prefill:]
        cu = [0]
        for n in prefill_lens:
            cu.append(cu[-1] + n)
        tensors = (
            torch.tensor(slots[:num_decodes], dtype=torch.int32),
            torch.tensor(slots[first_prefill:], dtype=torch.int32),
            torch.tensor(cu, dtype=torch.int32),
            torch.tensor([s > 0 for s in starts[first_prefill:]], dtype=torch.bool),
        )
        device = cache.conv_tensor.device
        if device.type != "cpu":
            tensors = tuple(t.to(device, non_blocking=True) for t in tensors)
        rounds = None
        if saves and any(saves):
            dtypes = (torch.int64, torch.int32, torch.int32, torch.bool, torch.int64, torch.int64)
            made = _rounds(slots[first_prefill:], starts[first_prefill:], prefill_lens, saves, cache.checkpoint_base)
            rounds = tuple(Round(*(torch.tensor(x, dtype=d).to(device, non_blocking=True) for x, d in zip(r, dtypes))) for r in made)
        if not num_verifies:
            return cls(cache, num_decodes, *tensors, rounds)
        verify_slots, verify_lens = slots[num_decodes:first_prefill], lens[num_decodes:first_prefill]
        made, saved = _positions(verify_slots, verify_lens, cache.verify_base)
        dtypes = (torch.int64, torch.int32, torch.int64, torch.int64)
        positions = tuple(Position(*(torch.tensor(x, dtype=d).to(device, non_blocking=True) for x, d in zip(p, dtypes))) for p in made)
        return cls(cache, num_decodes, *tensors, rounds, sum(verify_lens), positions, tuple(verify_slots), tuple(map(tuple, saved)))

    def by_positions(self, run: Callable[..., torch.Tensor], inputs: list[torch.Tensor], pool: torch.Tensor) -> torch.Tensor:
        """``run(inputs, slots)``, a one-token-per-slot op that keeps its state in ``pool`` (one layer's), over the verify
        rows position by position; after each position, each verify that goes on past it saves its state. Rows come
        back in the order they went in."""
        return _in_parts(self.verify_positions, inputs, pool, lambda part_inputs, p: run(part_inputs, p.slots))

    def keep_accepted(self, verify: int, accepted: int) -> None:
        """Verify ``verify`` (counted in the step's order) accepted ``accepted`` proposed tokens: its slot goes back to
        the state after its position ``accepted`` (the state after its last position is there already)."""
        saved = self.verify_saved[verify]
        if accepted < len(saved):
            self.cache.copy_(saved[accepted], self.verify_slots[verify])

    def by_rounds(self, run: Callable[..., torch.Tensor], inputs: list[torch.Tensor], pool: torch.Tensor) -> torch.Tensor:
        """``run(inputs, cu_seqlens, slots, has_initial_state)``, a varlen op over the prefill rows that keeps its state
        in ``pool`` (one layer's): in one call, or round by round where chunks save checkpoints, each round's
        checkpoints copied out of ``pool`` as soon as it ends. Rows come back in the order they went in."""
        if self.prefill_rounds is None:
            return run(inputs, self.prefill_cu_seqlens, self.prefill_slots, self.prefill_has_initial_state)
        return _in_parts(self.prefill_rounds, inputs, pool, lambda part_inputs, r: run(part_inputs, r.cu_seqlens, r.slots, r.has_initial_state))

    @classmethod
    def for_decode(cls, cache: GDNStateCache, decode_slots: torch.Tensor) -> SlotMetadata:
        """A decode-only step from the device tensor of its slots [B] int32 alone (what a CUDA graph captures)."""
        device = decode_slots.device
        return cls(
            cache,
            decode_slots.shape[0],
            decode_slots,
            torch.zeros(0, dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.zeros(0, dtype=torch.bool, device=device),
        )


def _in_parts(parts: Sequence[Any], inputs: list[torch.Tensor], pool: torch.Tensor, call: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``call(part_inputs, part)`` over each part's rows of ``inputs`` in turn (prefill rounds, verify positions), the
    results put back in the rows' order; after each part, the states it names copied within ``pool`` (``save_from`` →
    ``save_to``)."""
    out = None
    for part in parts:
        result = call([x.index_select(0, part.rows) for x in inputs], part)
        if out is None:
            out = result.new_empty(inputs[0].shape[0], *result.shape[1:])
        out.index_copy_(0, part.rows, result)
        if part.save_to.numel():
            pool.index_copy_(0, part.save_to, pool.index_select(0, part.save_from))
    return out
