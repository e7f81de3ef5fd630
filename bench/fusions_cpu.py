"""CPU fusions benchmark: the C++ fused residual-add + RMSNorm, SiLU-and-mul and in-place rotary
(``csrc/decoder_fusions.cpp``) against the torch ops the unfused decoder runs for each (the residual
``add_`` then ``RMSNorm``'s five ops; ``silu_`` then ``mul_``; ``roll``, ``mul_``, ``addcmul_``), per
call, at decode and prefill token counts of the default model's shapes, measured in the same run. fp32,
no checkpoint; each op is a few microseconds, so at decode sizes this is mostly per-op dispatch.

    .venv/bin/python -m bench.fusions_cpu [--hidden 576] [--inter 1536] [--heads 9] [--kv-heads 3] [--head-dim 64] [--tokens 1,8,32,256]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.worker.cpu_kernels import cpu_kernels
from services.worker.rmsnorm import RMSNorm
from services.worker.rotary import RotaryEmbedding, apply_rotary_


def per_call_us(fn: Callable[[], object], min_s: float = 0.2) -> float:
    for _ in range(20):
        fn()
    calls, began = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - began) < min_s:
        for _ in range(50):
            fn()
        calls += 50
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--inter", type=int, default=1536, help="intermediate size of the SwiGLU MLP")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tokens", default="1,8,32,256")
    args = parser.parse_args()
    kernels, why = cpu_kernels()
    if kernels is None:
        print(f"fusions_cpu: the C++ kernels did not build ({why}); skipped")
        return
    h, i, rotated, dim = args.hidden, args.inter, args.heads + args.kv_heads, args.head_dim
    torch.manual_seed(0)
    weight = 1 + 0.1 * torch.randn(h)
    norm = RMSNorm(weight, 1e-6)
    rotary = RotaryEmbedding(dim, 10000.0, {}, 4096, torch.float32)
    print(f"fusions_cpu: {torch.get_num_threads()} threads, hidden {h}, intermediate {i}, {rotated} rotated heads of {dim}, fp32")
    print(f"{'op':>13} {'tokens':>7} {'unfused us':>11} {'fused us':>9} {'unfused/fused':>14}")
    with torch.inference_mode():
        for tokens in [int(t) for t in args.tokens.split(",")]:
            x, residual = torch.randn(tokens, h), torch.randn(tokens, h)
            # Out of place here so the inputs stay as they are between calls (the decoder adds in place).
            row("add_rms_norm", tokens, per_call_us(lambda: norm(x + residual)), per_call_us(lambda: kernels.add_rms_norm(x, residual, weight, 1e-6)))  # noqa: B023

            gate_up = torch.randn(tokens, 2 * i)
            unfused = per_call_us(lambda: F.silu(gate_up[:, :i]).mul_(gate_up[:, i:]))  # noqa: B023
            row("silu_and_mul", tokens, unfused, per_call_us(lambda: kernels.silu_and_mul(gate_up)))  # noqa: B023

            cos, sin = rotary.lookup(torch.arange(tokens) * 7, 7 * tokens)
            qk = torch.randn(tokens, rotated + args.kv_heads, dim)[:, :rotated]  # q and k heads inside qkv
            row("rotary", tokens, per_call_us(lambda: apply_rotary_(qk, cos, sin)), per_call_us(lambda: kernels.rotary_(qk, cos, sin)))  # noqa: B023


def row(op: str, tokens: int, unfused_us: float, fused_us: float) -> None:
    print(f"{op:>13} {tokens:>7} {unfused_us:>11.1f} {fused_us:>9.1f} {unfused_us / fused_us:>13.2f}x")


if __name__ == "__main__":
    main()
