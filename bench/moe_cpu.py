"""CPU MoE benchmark: the grouped torch path of the worker (``services.worker.moe.experts_torch``:
pairs sorted by expert, two GEMMs per active expert, one weighted index_add) against a naive loop
over each token's experts, on synthetic Qwen3-MoE-shaped weights, both measured in the same run.

    .venv/bin/python -m bench.moe_cpu [--hidden 512] [--inter 256] [--experts 64] [--top-k 8] [--tokens 1,8,64,256]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.worker.moe import experts_torch, route


def per_token_loop(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The baseline: every (token, expert) pair as its own three matrix-vector products."""
    out = torch.zeros_like(x)
    inter = w_down.shape[2]
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate_up = w_gate_up[e] @ x[t]
            out[t] += w * (w_down[e] @ (F.silu(gate_up[:inter]) * gate_up[inter:]))
    return out


def median_seconds(fn: Callable[[], object], min_time: float = 0.3, min_runs: int = 3) -> float:
    fn()  # warm-up
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - began < min_time:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--inter", type=int, default=256, help="moe_intermediate_size")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", default="1,8,64,256", help="comma-separated token counts")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h, i, e, k = args.hidden, args.inter, args.experts, args.top_k
    w_gate_up = torch.randn(e, 2 * i, h) / h**0.5
    w_down = torch.randn(e, h, i) / i**0.5
    router = torch.randn(e, h) / h**0.5
    print(f"moe_cpu: hidden {h}, {e} experts of {i}, top-{k}, fp32, {args.threads} threads")
    print(f"{'tokens':>7} {'active':>7} {'grouped ms':>11} {'loop ms':>9} {'loop/grouped':>13}")
    ratios = []
    with torch.inference_mode():
        for tokens in map(int, args.tokens.split(",")):
            x = torch.randn(tokens, h)
            weights, ids = route(F.linear(x, router), k, renormalize=True)
            grouped = experts_torch(x, w_gate_up, w_down, weights, ids)
            loop = per_token_loop(x, w_gate_up, w_down, weights, ids)
            assert ((grouped - loop).norm() / loop.norm()).item() < 1e-5, "the two paths disagree"
            t_grouped = median_seconds(lambda: experts_torch(x, w_gate_up, w_down, weights, ids))  # noqa: B023
            t_loop = median_seconds(lambda: per_token_loop(x, w_gate_up, w_down, weights, ids))  # noqa: B023
            ratios.append(t_loop / t_grouped)
            print(f"{tokens:>7} {ids.unique().numel():>7} {t_grouped * 1e3:>11.3f} {t_loop * 1e3:>9.3f} {ratios[-1]:>12.1f}x")
    print(f"grouped torch MoE is {statistics.geometric_mean(ratios):.1f}x the per-token loop (geometric mean over token counts)")


if __name__ == "__main__":
    main()
