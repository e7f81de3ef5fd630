"""GPU MoE benchmark: the fused Triton MoE (``services.worker.kernels.fused_moe``) against the
grouped torch path (``services.worker.moe.experts_torch``) on one synthetic Qwen3-30B-A3B-shaped
layer (hidden 2048, 128 experts of 768, top-8, bf16): time, achieved GB/s (weights of the experts
actually routed to, plus activations in and out) and TFLOP/s, at decode batch sizes 1–64 and a
4096-token prefill. No network, no checkpoint; skips with a message when there is no CUDA device.

    .venv/bin/python -m bench.moe_gpu [--dtype bfloat16|float16] [--batches 1,2,4,8,16,32,64] [--prefill 4096]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from services.worker.moe import experts_torch, route


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768, help="moe_intermediate_size")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64", help="decode batch sizes (one token each)")
    parser.add_argument("--prefill", type=int, default=4096, help="tokens of the prefill point (0: none)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("moe_gpu: no CUDA device here; skipped (run it on a GPU host)")
        return
    try:
        import triton.testing

        from services.worker.kernels.fused_moe import default_config, fused_moe
    except ImportError as error:
        print(f"moe_gpu: triton is not importable ({error}); skipped")
        return

    dtype, device = getattr(torch, args.dtype), torch.device("cuda")
    h, i, e, k = args.hidden, args.inter, args.experts, args.top_k
    torch.manual_seed(0)
    w_gate_up = (torch.randn(e, 2 * i, h, device=device) / h**0.5).to(dtype)
    w_down = (torch.randn(e, h, i, device=device) / i**0.5).to(dtype)
    router = (torch.randn(e, h, device=device) / h**0.5).to(dtype)
    expert_bytes = (w_gate_up[0].numel() + w_down[0].numel()) * w_gate_up.element_size()
    print(f"moe_gpu: {torch.cuda.get_device_name()}, hidden {h}, {e} experts of {i}, top-{k}, {args.dtype}")
    print(f"{'tokens':>7} {'active':>6} {'config':>16} {'torch us':>9} {'triton us':>10} {'speed-up':>9} {'triton GB/s':>12} {'TFLOP/s':>8} {'rel err':>8}")
    points = [int(b) for b in args.batches.split(",")] + ([args.prefill] if args.prefill else [])
    with torch.inference_mode():
        for tokens in points:
            x = torch.randn(tokens, h, device=device, dtype=dtype)
            weights, ids = route(F.linear(x, router), k, renormalize=True)
            ours, reference = fused_moe(x, w_gate_up, w_down, weights, ids), experts_torch(x, w_gate_up, w_down, weights, ids)
            error = ((ours.float() - reference.float()).norm() / reference.float().norm()).item()
            t_torch = triton.testing.do_bench(lambda: experts_torch(x, w_gate_up, w_down, weights, ids), warmup=10, rep=50)  # noqa: B023
            t_triton = triton.testing.do_bench(lambda: fused_moe(x, w_gate_up, w_down, weights, ids), warmup=10, rep=50)  # noqa: B023
            active = ids.unique().numel()
            moved = active * expert_bytes + 2 * x.numel() * x.element_size()
            flops = 2 * tokens * k * 3 * h * i
            cfg = default_config(tokens, e)
            label = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/g{cfg.group_m}"
            print(
                f"{tokens:>7} {active:>6} {label:>16} {t_torch * 1e3:>9.1f} {t_triton * 1e3:>10.1f} {t_torch / t_triton:>8.2f}x "
                f"{moved / (t_triton * 1e-3) / 1e9:>12.0f} {flops / (t_triton * 1e-3) / 1e12:>8.1f} {error:>8.1e}"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
