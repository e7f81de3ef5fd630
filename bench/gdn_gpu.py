"""GPU Gated DeltaNet benchmark: the Triton kernels (``services.worker.kernels.gdn`` / ``.conv1d``) against the
torch forms (``services.worker.gdn``) at Qwen3-Next's head sizes (16 q/k heads, 32 v heads, 128 × 128 state):

1. parity in fp32 on a mixed batch (lengths 1000, 1, 77, 3018; initial states from slots out of order), then
   a decode step, so a kernel that only the GPU miscompiles shows up before any timing (exit status 1 if not);
2. chunked prefill of ``--prefill`` tokens (one sequence, and the same tokens as 8 sequences): time;
3. recurrent decode at batch 1–64: time, and achieved GB/s (state read + written, plus q/k/v/o) against a
   device-to-device copy of the same bytes measured in the same run;
4. the short causal conv1d (prefill and decode update) over the layer's q/k/v channels.

No network, no checkpoint; skips with a message when there is no CUDA device.

    .venv/bin/python -m bench.gdn_gpu [--dtype bfloat16|float16] [--batches 1,2,4,8,16,32,64] [--prefill 4096]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _inputs(tokens: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """What a GDN layer hands the delta rule: L2-normalised q/k, log-decay g ≤ 0 and β ∈ (0, 1) in fp32."""
    dev = gen.device
    return {
        "q": F.normalize(torch.randn(tokens, hk, dk, device=dev, generator=gen), dim=-1).to(dtype),
        "k": F.normalize(torch.randn(tokens, hk, dk, device=dev, generator=gen), dim=-1).to(dtype),
        "v": torch.randn(tokens, hv, dv, device=dev, generator=gen).to(dtype),
        "g": F.logsigmoid(torch.randn(tokens, hv, device=dev, generator=gen) + 3),
        "beta": torch.rand(tokens, hv, device=dev, generator=gen),
    }


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def _cu(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _cpu_time(fn: Callable[[], object]) -> float:
    """Milliseconds of one call (the --cpu smoke run: only that every path runs)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hk", type=int, default=16, help="q/k heads")
    parser.add_argument("--hv", type=int, default=32, help="v heads")
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--conv-width", type=int, default=4)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64", help="decode batch sizes (one token each)")
    parser.add_argument("--prefill", type=int, default=4096, help="tokens of the prefill points")
    parser.add_argument("--cpu", action="store_true", help="a smoke run of this script under TRITON_INTERPRET=1 (use tiny sizes; timings meaningless)")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gdn_gpu: no CUDA device here; skipped (run it on a GPU host)")
        return
    try:
        import triton.testing

        from services.worker.kernels import conv1d as triton_conv
        from services.worker.kernels import gdn as triton_gdn
    except ImportError as error:
        print(f"gdn_gpu: triton is not importable ({error}); skipped")
        return
    try:
        from services.worker import gdn as torch_gdn
    except ImportError as error:  # the kernels can still be timed on their own
        torch_gdn = None
        print(f"gdn_gpu: torch forms not importable ({error}); Triton only, no parity")

    dtype, device = getattr(torch, args.dtype), torch.device("cpu" if args.cpu else "cuda")
    hk, hv, dk, dv = args.hk, args.hv, args.dk, args.dv
    scale = dk**-0.5
    batches = [int(b) for b in args.batches.split(",")]
    num_slots = max(batches) + 8
    gen = torch.Generator(device=device).manual_seed(0)
    bench: Callable[[Callable[[], object]], float] = _cpu_time if args.cpu else lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50)  # ms
    print(
        f"gdn_gpu: {'cpu (interpreted)' if args.cpu else torch.cuda.get_device_name()}, Hk {hk}, Hv {hv}, Dk {dk}, Dv {dv}, {args.dtype}; state pool of {num_slots} slots"
    )

    parity_ok = True
    with torch.inference_mode():
        pool = 0.1 * torch.randn(num_slots, hv, dk, dv, device=device, generator=gen)
        if torch_gdn is not None:  # 1. parity in fp32
            rest = args.prefill - 78
            lengths = [rest // 4 - 4, 1, 77, rest - rest // 4 + 4]  # 1000, 1, 77, 3018 at the default 4096
            x = _inputs(sum(lengths), hk, hv, dk, dv, torch.float32, gen)
            slots = torch.randperm(num_slots, device=device, generator=gen)[: len(lengths)].to(torch.int32)
            initial = torch.tensor([True, False, True, True], device=device)
            cu = _cu(lengths, device)
            ours_pool, ref_pool = pool.clone(), pool.clone()
            o = triton_gdn.chunk_gated_delta_rule(*x.values(), scale, ours_pool, slots, cu, initial)
            ref = torch_gdn.chunk_gated_delta_rule(*x.values(), scale, ref_pool, slots, cu, initial)
            prefill_states = _rel(ours_pool, ref_pool)
            step = _inputs(len(lengths), hk, hv, dk, dv, torch.float32, gen)
            o_step = triton_gdn.fused_recurrent_gated_delta_rule(*step.values(), scale, ours_pool, slots)
            ref_step = torch_gdn.fused_recurrent_gated_delta_rule(*step.values(), scale, ref_pool, slots)
            others = ~torch.isin(torch.arange(num_slots, device=device), slots)
            errors = (_rel(o, ref), prefill_states, _rel(o_step, ref_step), _rel(ours_pool, ref_pool))
            parity_ok = max(errors) < 1e-4 and torch.equal(ours_pool[others], pool[others])  # fp32 rounding is ~1e-6
            print(
                f"fp32 parity with the torch forms: prefill out {errors[0]:.1e}, states {errors[1]:.1e}; then decode out {errors[2]:.1e}, "
                f"states {errors[3]:.1e}; untouched slots unchanged: {torch.equal(ours_pool[others], pool[others])} -> {'ok' if parity_ok else 'FAILED'}"
            )

        # 2. chunked prefill
        print(f"\n{'prefill':>18} {'torch ms':>9} {'triton ms':>10} {'speed-up':>9} {'Mtok/s':>7} {'rel err':>8}")
        for seqs in (1, 8):
            lengths = [args.prefill // seqs] * seqs
            x = _inputs(sum(lengths), hk, hv, dk, dv, dtype, gen)
            cu, slots = _cu(lengths, device), torch.arange(seqs, dtype=torch.int32, device=device)
            initial = torch.ones(seqs, dtype=torch.bool, device=device)
            triton_run = lambda: triton_gdn.chunk_gated_delta_rule(*x.values(), scale, pool, slots, cu, initial)  # noqa: B023, E731
            t_triton = bench(triton_run)
            t_torch, error = float("nan"), float("nan")
            if torch_gdn is not None:
                torch_run = lambda: torch_gdn.chunk_gated_delta_rule(*x.values(), scale, pool, slots, cu, initial)  # noqa: B023, E731
                t_torch = bench(torch_run)
                before = pool.clone()
                ours = triton_run()
                pool.copy_(before)
                error = _rel(ours, torch_run())
            label = f"{sum(lengths)} tok / {seqs} seq"
            print(f"{label:>18} {t_torch:>9.2f} {t_triton:>10.2f} {t_torch / t_triton:>8.2f}x {sum(lengths) / t_triton / 1e3:>7.2f} {error:>8.1e}")

        # 3. recurrent decode against a device-to-device copy of the same bytes
        print(
            f"\n{'decode batch':>12} {'torch us':>9} {'triton us':>10} {'speed-up':>9} {'MB moved':>9} {'triton GB/s':>12} {'copy GB/s':>10} {'of copy':>8} {'rel err':>8}"
        )
        for batch in batches:
            x = _inputs(batch, hk, hv, dk, dv, dtype, gen)
            slots = torch.randperm(num_slots, device=device, generator=gen)[:batch].to(torch.int32)
            t_triton = bench(lambda: triton_gdn.fused_recurrent_gated_delta_rule(*x.values(), scale, pool, slots))  # noqa: B023
            t_torch, error = float("nan"), float("nan")
            if torch_gdn is not None:
                t_torch = bench(lambda: torch_gdn.fused_recurrent_gated_delta_rule(*x.values(), scale, pool, slots))  # noqa: B023
                before = pool.clone()
                ours = triton_gdn.fused_recurrent_gated_delta_rule(*x.values(), scale, pool, slots)
                pool.copy_(before)
                error = _rel(ours, torch_gdn.fused_recurrent_gated_delta_rule(*x.values(), scale, pool, slots))
            state_bytes = batch * hv * dk * dv * 4
            moved = 2 * state_bytes + sum(t.numel() * t.element_size() for t in x.values()) + batch * hv * dv * x["v"].element_size()
            src = torch.empty(state_bytes // 4, device=device)
            dst = torch.empty_like(src)
            t_copy = bench(lambda: dst.copy_(src))  # noqa: B023  (reads and writes state_bytes)
            gbs, copy_gbs = moved / (t_triton * 1e-3) / 1e9, 2 * state_bytes / (t_copy * 1e-3) / 1e9
            print(
                f"{batch:>12} {t_torch * 1e3:>9.1f} {t_triton * 1e3:>10.1f} {t_torch / t_triton:>8.2f}x {moved / 1e6:>9.1f} "
                f"{gbs:>12.0f} {copy_gbs:>10.0f} {gbs / copy_gbs:>7.0%} {error:>8.1e}"
            )

        # 4. the short convolution over the q/k/v channels
        channels, width = 2 * hk * dk + hv * dv, args.conv_width
        weight = torch.randn(channels, width, device=device, generator=gen).to(dtype)
        bias = None
        conv_pool = torch.randn(num_slots, channels, width - 1, device=device, generator=gen).to(dtype)
        print(f"\n{'conv1d (' + str(channels) + ' ch)':>22} {'torch us':>9} {'triton us':>10} {'speed-up':>9} {'rel err':>8}")
        cases = [("prefill", [args.prefill // 8] * 8)] + [(f"decode x{b}", [1] * b) for b in (1, 64) if b <= num_slots]
        for name, lengths in cases:
            xs = torch.randn(sum(lengths), channels, device=device, generator=gen).to(dtype)
            cu, slots = _cu(lengths, device), torch.arange(len(lengths), dtype=torch.int32, device=device)
            initial = torch.ones(len(lengths), dtype=torch.bool, device=device)
            if name == "prefill":
                ours_fn = lambda: triton_conv.causal_conv1d_varlen(xs, cu, conv_pool, slots, initial, weight, bias)  # noqa: B023, E731
                ref_fn = torch_gdn and (lambda: torch_gdn.causal_conv1d_varlen(xs, cu, conv_pool, slots, initial, weight, bias))  # noqa: B023
            else:
                ours_fn = lambda: triton_conv.causal_conv1d_update(xs, conv_pool, slots, weight, bias)  # noqa: B023, E731
                ref_fn = torch_gdn and (lambda: torch_gdn.causal_conv1d_update(xs, conv_pool, slots, weight, bias))  # noqa: B023
            t_triton = bench(ours_fn)
            t_torch, error = float("nan"), float("nan")
            if ref_fn:
                t_torch = bench(ref_fn)
                before = conv_pool.clone()
                ours = ours_fn()
                conv_pool.copy_(before)
                error = _rel(ours, ref_fn())
            print(f"{name:>22} {t_torch * 1e3:>9.1f} {t_triton * 1e3:>10.1f} {t_torch / t_triton:>8.2f}x {error:>8.1e}")
    sys.stdout.flush()
    if not parity_ok:
        sys.exit("gdn_gpu: the Triton kernels disagree with the torch forms in fp32 (see above)")


if __name__ == "__main__":
    main()
