"""GPU fusions benchmark: the Triton fused residual-add + RMSNorm and SiLU-and-mul
(``services.worker.kernels.fusions``) against the unfused torch ops the decoder would otherwise run on
the GPU (the residual ``add_`` of the output projection, then ``RMSNorm``'s ops; ``silu`` then ``mul_``),
at decode and prefill token counts, measured in the same run: time, the unfused/fused ratio, and the
fused kernels' achieved GB/s (bytes read + written) to hold against the device copy bandwidth that
``bench/gpu_decode.py`` prints. No network, no checkpoint; skips with a message when there is no CUDA device.

    .venv/bin/python -m bench.fusions_gpu [--hidden 4096] [--inter 12288] [--tokens 1,8,32,256,2048]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from services.worker.fusions import add_rms_norm_torch, silu_and_mul_torch
from services.worker.rmsnorm import RMSNorm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=12288, help="intermediate size of the SwiGLU MLP")
    parser.add_argument("--tokens", default="1,8,32,256,2048")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fusions_gpu: no CUDA device here; skipped (run it on a GPU host)")
        return
    try:
        import triton.testing

        from services.worker.kernels.fusions import add_rms_norm, silu_and_mul
    except ImportError as error:
        print(f"fusions_gpu: triton is not importable ({error}); skipped")
        return

    dtype, device, h, i = getattr(torch, args.dtype), torch.device("cuda"), args.hidden, args.inter
    size = torch.finfo(dtype).bits // 8
    torch.manual_seed(0)
    weight = (1 + 0.1 * torch.randn(h, device=device)).to(dtype)
    norm = RMSNorm(weight, 1e-6)
    print(f"fusions_gpu: {torch.cuda.get_device_name()}, hidden {h}, intermediate {i}, {args.dtype}")
    print(f"{'op':>13} {'tokens':>7} {'unfused us':>11} {'fused us':>9} {'unfused/fused':>14} {'fused GB/s':>11} {'max err':>8}")

    # The decoder's unfused kernels, out of place so the inputs stay as they are between repetitions (the
    # same reads and writes as its in-place add_ on o_proj's output and DenseMLP's in-place silu).
    def unfused_add_norm(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return norm(x + residual)

    def unfused_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate_up[:, :i]).mul_(gate_up[:, i:])

    with torch.inference_mode():
        for tokens in [int(t) for t in args.tokens.split(",")]:
            x, residual = torch.randn(tokens, h, device=device, dtype=dtype), torch.randn(tokens, h, device=device, dtype=dtype)
            out, _ = add_rms_norm(x, residual, weight, 1e-6)
            error = (out.float() - add_rms_norm_torch(x, residual, weight, 1e-6)[0].float()).abs().max().item()
            t_unfused = triton.testing.do_bench(lambda: unfused_add_norm(x, residual), warmup=10, rep=40)  # noqa: B023
            t_fused = triton.testing.do_bench(lambda: add_rms_norm(x, residual, weight, 1e-6), warmup=10, rep=40)  # noqa: B023
            moved = 4 * tokens * h * size  # x and residual in, normed and residual out
            row("add_rms_norm", tokens, t_unfused, t_fused, moved, error)

            gate_up = torch.randn(tokens, 2 * i, device=device, dtype=dtype)
            error = (silu_and_mul(gate_up).float() - silu_and_mul_torch(gate_up).float()).abs().max().item()
            t_unfused = triton.testing.do_bench(lambda: unfused_silu_mul(gate_up), warmup=10, rep=40)  # noqa: B023
            t_fused = triton.testing.do_bench(lambda: silu_and_mul(gate_up), warmup=10, rep=40)  # noqa: B023
            row("silu_and_mul", tokens, t_unfused, t_fused, 3 * tokens * i * size, error)


def row(op: str, tokens: int, unfused_ms: float, fused_ms: float, moved: int, error: float) -> None:
    print(
        f"{op:>13} {tokens:>7} {unfused_ms * 1e3:>11.1f} {fused_ms * 1e3:>9.1f} {unfused_ms / fused_ms:>13.2f}x {moved / fused_ms / 1e6:>11.0f} {error:>8.1e}"
    )


if __name__ == "__main__":
    main()
