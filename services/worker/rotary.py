"""Rotary position embedding: a cos/sin table built once, looked up once per step, applied in place.

Supports the plain schedule (``rope_theta``) and Llama 3's frequency scaling; the config may
spell them the old way (``rope_theta`` + ``rope_scaling``) or the new (``rope_parameters``).
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, blended, scaled)


def rope_config(config: dict) -> tuple[float, dict]:
    """``(rope_theta, scaling parameters)`` from a config.json, whichever way it spells them."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta), params


class RotaryEmbedding:
    """cos and sin for every position up to ``max_positions``; the table grows if a step goes past it."""

    def __init__(self, head_dim: int, theta: float, scaling: dict, max_positions: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.head_dim, self.dtype, self.device = head_dim, dtype, device
        self.inv_freq = _inverse_frequencies(head_dim, theta, scaling)
        self._build(max_positions)

    def _build(self, num_positions: int) -> None:
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), self.inv_freq)
        self.cos = freqs.cos().repeat(1, 2).to(self.device, self.dtype)
        # rotate_half(x) * sin == x.roll(half) * [-sin, sin]: the sign is folded into the table.
        sin = freqs.sin()
        self.sin = torch.cat((-sin, sin), dim=-1).to(self.device, self.dtype)

    def lookup(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim], broadcastable over heads."""
        if max_position >= self.cos.shape[0]:
            self._build(max(2 * self.cos.shape[0], max_position + 1))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x`` [T, heads, head_dim] in place (it may be a view into the fused qkv output)."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1)
    x.mul_(cos).addcmul_(rotated, sin)
