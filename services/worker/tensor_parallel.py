"""Tensor parallelism of the worker: R ranks over torch.distributed (gloo on CPU, NCCL on GPU).

Each rank holds 1/R of every layer: whole attention heads of q/k/v and the KV cache, and 1/R of
the MLP's (and every expert's) intermediate columns of gate/up; o_proj and down are split along
their input, so each rank's output is a partial sum that one ``all_reduce`` completes, the
residual counted once (by rank 0). Embedding, norms, router and lm_head are replicated.

Rank 0, the leader, is the worker the scheduler talks to: it broadcasts every ``StepPlan`` and
``Release`` to the followers as the frame's msgpack bytes (never pickle), samples, and
broadcasts the sampled tokens so every rank feeds the same token to the next decode.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shared.codec import decode, encode
from shared.frames import Frame

SUPPORTED_FAMILIES = ("llama", "qwen3", "qwen3_moe")
_COLUMN_PARALLEL = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias", "gate_proj.weight", "up_proj.weight")
_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    size: int
    device: torch.device  # where collectives run: cpu for gloo, the rank's GPU for NCCL

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    # Leader -> followers. ----------------------------------------------------------------

    def send_frame(self, frame: Frame | None) -> None:
        """Leader: the next frame every follower runs (None: stop)."""
        data = b"" if frame is None else encode(frame)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64, device=self.device), 0)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device), 0)

    def receive_frame(self) -> Frame | None:
        """Follower: the frame the leader sent next (None: stop)."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.broadcast(size, 0)
        if not size.item():
            return None
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, 0)
        return decode(data.cpu().numpy().tobytes())

    def share_tokens(self, tokens: torch.Tensor | None, count: int) -> torch.Tensor:
        """The leader's sampled tokens, on every rank (followers pass None)."""
        buffer = tokens.to(self.device, torch.int64) if self.leader else torch.empty(count, dtype=torch.int64, device=self.device)
        dist.broadcast(buffer, 0)
        return buffer.cpu()


def init_group(rank: int, size: int, init_method: str, timeout_s: float = 600.0) -> TensorParallelGroup:
    """Joins the ranks' process group (blocks until all ``size`` ranks have joined)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    return TensorParallelGroup(rank, size, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))


# Sharding. ---------------------------------------------------------------------------------


def shard_config(config: dict, size: int) -> dict:
    """config.json as one rank sees its shard: 1/size of the heads and intermediate columns."""
    family = config.get("model_type", "llama")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"--tensor-parallel-size {size}: model_type {family!r} is not supported with tensor parallelism (supported: {', '.join(SUPPORTED_FAMILIES)})"
        )
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    sizes = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": config["intermediate_size"]}
    if family == "qwen3_moe":
        sizes["moe_intermediate_size"] = config["moe_intermediate_size"]
    uneven = [f"{name}={value}" for name, value in sizes.items() if value % size]
    if uneven:
        raise ValueError(f"--tensor-parallel-size {size} must divide {', '.join(uneven)}")
    return {
        **config,
        **{name: value // size for name, value in sizes.items()},
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,  # not hidden / the rank's heads
    }


def shard_weights(weights: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """This rank's tensors (owned copies): column-parallel ones split by output rows, row-parallel
    ones by input columns, o_proj's bias kept by rank 0 only (it is added once); the rest as is."""
    shard: dict[str, torch.Tensor] = {}
    for name in list(weights):
        tensor = weights.pop(name)
        if name.endswith(_COLUMN_PARALLEL):
            tensor = tensor.chunk(size, 0)[rank]
        elif name.endswith(_ROW_PARALLEL):
            tensor = tensor.chunk(size, 1)[rank]
        elif name.endswith("o_proj.bias"):
            tensor = tensor if rank == 0 else torch.zeros_like(tensor)
        elif name.endswith("experts.gate_up_proj"):  # fused [E, 2I, H]: gate rows, then up rows
            gate, up = tensor.chunk(2, 1)
            tensor = torch.cat([gate.chunk(size, 1)[rank], up.chunk(size, 1)[rank]], 1)
        elif name.endswith("experts.down_proj"):  # fused [E, H, I]
            tensor = tensor.chunk(size, 2)[rank]
        shard[name] = tensor.clone(memory_format=torch.contiguous_format)
    return shard


class _ReducedBlock:
    """A row-parallel block ``residual + f(x)``: rank 0 adds the residual, the other ranks zero,
    and the partial sums are all_reduced, so every rank holds the full result."""

    def __init__(self, block, group: TensorParallelGroup) -> None:
        self.block, self.group = block, group

    def tensors(self) -> list[torch.Tensor]:
        return self.block.tensors()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, *rest) -> torch.Tensor:
        out = self.block(x, residual if self.group.leader or residual is None else torch.zeros_like(residual), *rest)
        return self.group.all_reduce(out)


def parallelize(model, group: TensorParallelGroup) -> None:
    """Wraps each layer's attention and MLP of a model built from a shard in their all_reduce."""
    model.layers = [layer._replace(attn=_ReducedBlock(layer.attn, group), mlp=_ReducedBlock(layer.mlp, group)) for layer in model.layers]
