"""Gated DeltaNet state slots on the worker: the tensors, and one step's view of which slot each slice uses.

A slot holds one request's whole GDN state: per GDN layer, the conv1d history (the last ``K − 1``
inputs, in the model dtype) and the recurrent state (fp32). The scheduler hands slots out and takes
them back; the worker never clears one: a request's first chunk reads zeros instead of its slot
(``has_initial_state`` False), so a slot reused after an abort or a preemption starts clean. With
decode graphs, the worker's pool has one slot more than the scheduler hands out: the dummy slot of
graph padding rows, which is zeroed on every replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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
    """``conv[i]`` [num_slots, C, K − 1] and ``recurrent[i]`` [num_slots, Hv, Dk, Dv] fp32 of GDN layer i."""

    def __init__(self, shape: GDNShape, num_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        if num_slots < 1:
            raise ValueError(f"a hybrid model needs at least one state slot, got {num_slots}")
        self.shape, self.num_slots = shape, num_slots
        self.conv_tensor = torch.zeros(shape.num_layers, num_slots, shape.conv_channels, shape.conv_history, dtype=dtype, device=device)
        self.recurrent_tensor = torch.zeros(shape.num_layers, num_slots, shape.num_v_heads, shape.key_dim, shape.value_dim, dtype=torch.float32, device=device)
        self.conv, self.recurrent = list(self.conv_tensor.unbind(0)), list(self.recurrent_tensor.unbind(0))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_tensor, self.recurrent_tensor))

    def zero_slot_(self, slot: int) -> None:
        """Clear one slot's state in every layer (two kernels, no host sync: it may run inside a graph)."""
        self.conv_tensor[:, slot].zero_()
        self.recurrent_tensor[:, slot].zero_()


@dataclass(frozen=True)
class SlotMetadata:
    """One step's slots, in flat-batch order: ``num_decodes`` decode slices (one token each), then prefill chunks.

    ``prefill_cu_seqlens`` delimits the prefill chunks' rows, counted from the first prefill row.
    """

    cache: GDNStateCache
    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] int32
    prefill_slots: torch.Tensor  # [P] int32
    prefill_cu_seqlens: torch.Tensor  # [P + 1] int32
    prefill_has_initial_state: torch.Tensor  # [P] bool: the chunk continues a prefill (start > 0)

    @classmethod
    def build(cls, cache: GDNStateCache, slots: list[int], starts: list[int], lens: list[int], num_decodes: int) -> SlotMetadata:
        """Built on the CPU, then moved to the device the state lives on (where the kernels read it)."""
        prefill_lens = lens[num_decodes:]
        cu = [0]
        for n in prefill_lens:
            cu.append(cu[-1] + n)
        tensors = (
            torch.tensor(slots[:num_decodes], dtype=torch.int32),
            torch.tensor(slots[num_decodes:], dtype=torch.int32),
            torch.tensor(cu, dtype=torch.int32),
            torch.tensor([s > 0 for s in starts[num_decodes:]], dtype=torch.bool),
        )
        device = cache.conv_tensor.device
        if device.type != "cpu":
            tensors = tuple(t.to(device, non_blocking=True) for t in tensors)
        return cls(cache, num_decodes, *tensors)

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
