"""CPU MoE benchmark: one MoE layer's experts on synthetic Qwen3-MoE-shaped weights, the worker's fp32
grouped torch path (``services.worker.moe.experts_torch``: pairs sorted by expert, two GEMMs per active
expert, one weighted index_add) against the grouped C++ call over experts in blocks
(``csrc/grouped_moe.cpp``) per format, routing included in both, all measured in the same run in
alternating rounds (the machine may be shared: the spread across rounds is reported).

    .venv/bin/python -m bench.moe_cpu [--hidden 576] [--inter 192] [--experts 64] [--top-k 8] [--tokens 1,8,32] [--rounds 5] [--cold-layers 30]

One layer called again and again finds its experts in the caches (a layer's q4_0 experts are 12 MB), which a
model step does not: ``--cold-layers N`` adds, per block format, N distinct layers called in turn (a model's
worth at 30: 360 MB of q4_0 experts, more than a last-level cache holds), timed per layer (``q4_0 x30``), with
the expert bytes its routed experts read per second, so the table shows what reading them from memory adds.
Tiles take two panels at a time from the rows a worker on this CPU would (``kernel_settings.pair_tiles_from``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.worker.block_quant import BLOCK_BYTES, BlockQuantized
from services.worker.cpu_kernels import cpu_kernels
from services.worker.kernel_settings import pair_tiles_from
from services.worker.moe import SparseMoE, experts_torch, route


def median_seconds(fn: Callable[[], object], min_time: float = 0.2, min_runs: int = 5) -> float:
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
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--inter", type=int, default=192, help="moe_intermediate_size")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", default="1,8,32", help="comma-separated token counts")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of every variant")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--cold-layers", type=int, default=0, help="also time this many distinct layers per block format, called in turn (0: off)")
    parser.add_argument(
        "--takeover-pool", action=argparse.BooleanOptionalAction, default=True, help="few-row calls on the takeover pool, as the worker runs them"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels()[0]
    if kernels is None:
        raise SystemExit(f"the CPU kernels are unavailable: {cpu_kernels()[1]}")
    kernels.set_takeover_pool(args.takeover_pool)
    pair_rows, pairs = pair_tiles_from(kernels.block_quant_wide_product_rate())  # the tiles a worker on this CPU takes
    kernels.set_block_quant_pair_min_rows(pair_rows)
    torch.manual_seed(0)
    h, i, e, k = args.hidden, args.inter, args.experts, args.top_k
    w_gate_up, w_down = torch.randn(e, 2 * i, h) / h**0.5, torch.randn(e, h, i) / i**0.5
    router = torch.randn(e, h) / h**0.5
    layers = {fmt: SparseMoE(router, BlockQuantized.of(w_gate_up, fmt), BlockQuantized.of(w_down, fmt), k, True, "torch") for fmt in BLOCK_BYTES}
    cold: dict[str, list[SparseMoE]] = {fmt: [] for fmt in BLOCK_BYTES if args.cold_layers}
    for _ in range(args.cold_layers):  # each layer's own weights and router, in every format
        gate_up, down, own_router = torch.randn(e, 2 * i, h) / h**0.5, torch.randn(e, h, i) / i**0.5, torch.randn(e, h) / h**0.5
        for fmt, stack in cold.items():
            stack.append(SparseMoE(own_router, BlockQuantized.of(gate_up, fmt), BlockQuantized.of(down, fmt), k, True, "torch"))

    def torch_path(x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, router), k, renormalize=True)
        return experts_torch(x, w_gate_up, w_down, weights, ids)

    print(f"moe_cpu: hidden {h}, {e} experts of {i}, top-{k}, {args.threads} threads, block ISA {kernels.block_quant_gemm_isa()}, {args.rounds} rounds")
    print(f"pair tiles {pairs}")
    print(f"{'tokens':>6} {'variant':>9} {'median ms':>10} {'min..max ms':>15} {'vs fp32 torch':>14} {'rel. error':>11}")
    with torch.inference_mode():
        for tokens in map(int, args.tokens.split(",")):
            x = torch.randn(tokens, h)
            variants: dict[str, Callable[[], torch.Tensor]] = {"fp32": lambda x=x: torch_path(x)}
            variants |= {fmt: lambda x=x, moe=moe: moe(x, None) for fmt, moe in layers.items()}
            variants |= {f"{fmt} x{len(stack)}": lambda x=x, stack=stack: [moe(x, None) for moe in stack] for fmt, stack in cold.items()}
            reference = torch_path(x)
            errors = {name: float((fn() - reference).norm() / reference.norm()) for name, fn in variants.items() if name in layers or name == "fp32"}
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, fn in variants.items():
                    times[name].append(median_seconds(fn) / (args.cold_layers if name not in errors else 1))  # per layer
            base = statistics.median(times["fp32"])
            for name, ts in times.items():
                mid = statistics.median(ts)
                spread = f"{min(ts) * 1e3:.3f}..{max(ts) * 1e3:.3f}"
                last = f"{errors[name]:>11.1e}" if name in errors else f"  {read_bytes(name, x, cold) / mid / 1e9:.1f} GB/s of experts read"
                print(f"{tokens:>6} {name:>9} {mid * 1e3:>10.3f} {spread:>15} {base / mid:>13.2f}x {last}")


def read_bytes(name: str, x: torch.Tensor, cold: dict[str, list[SparseMoE]]) -> float:
    """The expert bytes one layer of a cold variant reads for ``x``, averaged over its layers: its routed experts' blocks."""
    stack = cold[name.split()[0]]
    total = 0.0
    for moe in stack:
        _, ids = route(F.linear(x, moe.router), moe.top_k, renormalize=True)
        experts = moe.panels.gate_up.shape[0]
        total += (moe.panels.gate_up.nbytes + moe.panels.down.nbytes) / experts * ids.unique().numel()
    return total / len(stack)


if __name__ == "__main__":
    main()
