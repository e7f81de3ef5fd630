"""The sparse Mixture-of-Experts MLP: a softmax router sends each token to its top-k SwiGLU experts.

Each layer's experts are stacked into one ``[E, 2I, H]`` gate_up and one ``[E, H, I]`` down tensor.
The torch path (the CPU production path, and the reference of the Triton kernels) groups the
(token, expert) pairs by expert: one sort, one pair of GEMMs per active expert, one weighted
``index_add`` back. The fused Triton path (``services/worker/kernels``) is chosen once, at load,
when the weights live on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# (x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], topk_weights [T, k], topk_ids [T, k], residual [T, H] | None) -> [T, H]
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (in fp32) over the experts, top-k, optionally renormalised to sum to 1:
    ``(weights [T, k] in the logits' dtype, expert ids [T, k])``, as transformers' Qwen3-MoE router."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def experts_torch(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + Σ_j topk_weights[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t))`` with ``e = topk_ids[t, j]``.

    The T·k pairs are sorted by expert (stable: within an expert, in token order) so each active
    expert runs as two GEMMs over its contiguous rows; experts that receive no token cost nothing.
    """
    top_k, inter = topk_ids.shape[1], w_down.shape[2]
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    token = order // top_k
    rows_in = x.index_select(0, token)
    rows_out = torch.empty_like(rows_in)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            gate_up = F.linear(rows_in[rows], w_gate_up[expert])
            act = F.silu(gate_up[:, :inter], inplace=True).mul_(gate_up[:, inter:])
            torch.mm(act, w_down[expert].t(), out=rows_out[rows])
            start += n
    rows_out.mul_(topk_weights.flatten()[order, None].to(rows_out.dtype))
    return (torch.zeros_like(x) if residual is None else residual).index_add(0, token, rows_out)


def _experts_triton() -> ExpertsFn:
    from services.worker.kernels.fused_moe import fused_moe  # imports triton: only on the GPU path

    return fused_moe


MOE_BACKENDS: dict[str, Callable[[], ExpertsFn]] = {"torch": lambda: experts_torch, "triton": _experts_triton}


def select_moe_backend(device: torch.device) -> str:
    """The fused Triton kernels where the weights are on CUDA, else the grouped torch path."""
    return "triton" if device.type == "cuda" else "torch"


class SparseMoE:
    """Post-attention-normed ``x`` → ``residual + moe(x)``; an ``MLP`` of the shared decoder."""

    def __init__(self, router: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int, renormalize: bool, backend: str) -> None:
        num_experts, hidden = router.shape
        if w_gate_up.shape[0] != num_experts or w_gate_up.shape[2] != hidden or w_down.shape != (num_experts, hidden, w_gate_up.shape[1] // 2):
            raise ValueError(f"expert weights {tuple(w_gate_up.shape)} / {tuple(w_down.shape)} do not fit a router of {num_experts} experts × {hidden}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts}")
        self.router, self.w_gate_up, self.w_down = router, w_gate_up.contiguous(), w_down.contiguous()
        self.top_k, self.renormalize, self.backend = top_k, renormalize, backend
        self._experts = MOE_BACKENDS[backend]()

    @classmethod
    def load(cls, w: dict[str, torch.Tensor], prefix: str, top_k: int, renormalize: bool, backend: str) -> SparseMoE:
        """From ``{prefix}gate.weight`` (the router) and the experts under ``{prefix}experts.``, stored
        either fused (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], as transformers 5 holds
        them in memory) or one expert at a time (``{e}.{gate,up,down}_proj.weight``, as its
        ``save_pretrained`` and the published checkpoints write them). Per-expert tensors are popped
        from ``w`` as they are stacked, so loading holds at most one layer's experts twice."""
        router, p = w[prefix + "gate.weight"], prefix + "experts."
        if p + "gate_up_proj" in w:
            return cls(router, w[p + "gate_up_proj"], w[p + "down_proj"], top_k, renormalize, backend)
        num_experts = router.shape[0]
        inter, hidden = w[p + "0.gate_proj.weight"].shape
        gate_up = torch.empty(num_experts, 2 * inter, hidden, dtype=router.dtype, device=router.device)
        down = torch.empty(num_experts, hidden, inter, dtype=router.dtype, device=router.device)
        for e in range(num_experts):
            gate_up[e, :inter] = w.pop(f"{p}{e}.gate_proj.weight")
            gate_up[e, inter:] = w.pop(f"{p}{e}.up_proj.weight")
            down[e] = w.pop(f"{p}{e}.down_proj.weight")
        return cls(router, gate_up, down, top_k, renormalize, backend)

    def tensors(self) -> list[torch.Tensor]:
        return [self.router, self.w_gate_up, self.w_down]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.router), self.top_k, self.renormalize)
        return self._experts(x, self.w_gate_up, self.w_down, weights, ids, residual)
