"""Gated DeltaNet state slots on the worker: the tensors, and one step's view of which slot each slice uses.

A slot holds one request's whole GDN state: per GDN layer, the conv1d history (the last ``K − 1``
inputs, in the model dtype) and the recurrent state (fp32). The scheduler hands slots out and takes
them back; the worker never clears one: a request's first chunk reads zeros instead of its slot
(``has_initial_state`` False), so a slot reused after an abort or a preemption starts clean.
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
        prefill_lens = lens[num_decodes:]
        cu = [0]
        for n in prefill_lens:
            cu.append(cu[-1] + n)
        return cls(
            cache=cache,
            num_decodes=num_decodes,
            decode_slots=torch.tensor(slots[:num_decodes], dtype=torch.int32),
            prefill_slots=torch.tensor(slots[num_decodes:], dtype=torch.int32),
            prefill_cu_seqlens=torch.tensor(cu, dtype=torch.int32),
            prefill_has_initial_state=torch.tensor([s > 0 for s in starts[num_decodes:]], dtype=torch.bool),
        )
