"""What another process's CPU on the worker's spare cores costs the worker: the exchange rate behind
bench.stack_throughput's one-stream ratio.

The worker runs in process with the stack's settings, its threads placed as the stack places them (the
main thread on a core of its own, the pool's helpers on the others). Beside it a burner process on those
other cores wakes every --period-ms and burns --burn-us of CPU, either in registers (and one cache line) or walking
--touch-mb of memory (as a service's cold pass does). Rounds alternate: no burner, each burner, and the
worker on one thread. For each burner the report gives output tokens/s, the extra milliseconds per token
against no burner, the burner's milliseconds per token, and their quotient u, what the worker loses per
unit of the burner's CPU:

- 0: free, the burner ran only while the helpers had nothing to do;
- the helpers' share of the step (1 - one thread's tokens/s / all threads'): the pool's takeover works as
  designed, the main thread finishing what the preempted helper left;
- 1: the worker stood still for the whole burn.

One stream of the stack puts ~0.75 ms of other processes' CPU per token on those cores (the api,
detokenizer, scheduler and their ZeroMQ threads, the client; bench.stack_throughput); at a u of about
0.6 that is the ~10 % between the stack and the worker alone.

    python -m bench.service_interference [--burn-us 600] [--touch-mb 4] [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from statistics import median

from bench.report import write_results
from shared.config import DEFAULT_MODEL_DIR, StackConfig


def burn(burn_us: float, touch_mb: float, period_s: float, cpus: set[int]) -> None:
    """The burner's loop (in its own process): sleep ``period_s``, then burn ``burn_us`` of CPU."""
    os.sched_setaffinity(0, cpus)
    memory = bytearray(max(64, int(touch_mb * (1 << 20))))
    stride = 4099 if touch_mb else 0  # a prime number of bytes: every access a new cache line
    while True:
        time.sleep(period_s)
        end, i = time.perf_counter() + burn_us / 1e6, 0
        while time.perf_counter() < end:
            memory[i] = (memory[i] + 1) & 255
            i = (i + stride) % len(memory)


def loss_per_burn(base_tok_s: float, tok_s: float, burn_us: float, period_s: float) -> dict[str, float]:
    """The extra ms per token a burner cost, the burner's CPU ms per token, and their quotient u."""
    token_ms = 1000 / tok_s
    extra_ms = token_ms - 1000 / base_tok_s
    burn_ms = burn_us / 1000 * token_ms / (period_s * 1000 + burn_us / 1000)  # one burn per sleep + burn
    return {"extra_ms_per_token": extra_ms, "burn_ms_per_token": burn_ms, "u": extra_ms / burn_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--burn-us", type=float, default=600)
    parser.add_argument("--touch-mb", type=float, default=4)
    parser.add_argument("--period-ms", type=float, default=4.5, help="the burner's sleep between burns (about one step)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default="bench/results/service_interference.json")
    parser.add_argument("--as-burner", nargs=4, metavar=("US", "MB", "PERIOD_S", "CPUS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_burner:
        us, mb, period, cpus = args.as_burner
        burn(float(us), float(mb), float(period), {int(c) for c in cpus.split(",")})
        return

    import torch

    from bench.stack_throughput import in_process_run, in_process_runner
    from shared.cpu_placement import take_worker_core

    runner, tokenizer, scheduler, depth = in_process_runner(args.model, [])
    config = StackConfig.from_argv(["--model", args.model, "--device", "cpu"])
    allowed = os.sched_getaffinity(0)
    core = take_worker_core(config)
    if core is None:
        raise SystemExit("the worker's placement needs two CPUs and a CPU worker")
    spare = ",".join(str(c) for c in sorted(allowed - {core}))
    period_s = args.period_ms / 1000
    burners = {"registers": 0.0, f"{args.touch_mb:g} MB": args.touch_mb}
    threads = torch.get_num_threads()
    tok_s: dict[str, list[float]] = {name: [] for name in ["none", *burners, "one thread"]}
    for index in range(args.rounds):
        names = list(tok_s) if index % 2 == 0 else list(reversed(tok_s))
        for name in names:
            burner = None
            if name in burners:
                command = [sys.executable, "-m", "bench.service_interference", "--as-burner", str(args.burn_us), str(burners[name]), str(period_s), spare]
                burner = subprocess.Popen(command)
                time.sleep(0.3)  # started and burning
            if name == "one thread":
                torch.set_num_threads(1)
            try:
                tok_s[name].append(in_process_run(1, args.output_tokens, runner, tokenizer, scheduler, depth)["output_tok_s"])
            finally:
                if burner is not None:
                    burner.kill()
                    burner.wait()
                if name == "one thread":  # the pool is rebuilt, its new helpers started on this thread's core: place them again
                    torch.set_num_threads(threads)
                    in_process_run(1, 2, runner, tokenizer, scheduler, depth)
                    take_worker_core(config)
        print(f"round {index + 1}: " + ", ".join(f"{name} {values[-1]:.1f}" for name, values in tok_s.items()) + " tok/s", flush=True)

    medians = {name: median(values) for name, values in tok_s.items()}
    helper_share = 1 - medians["one thread"] / medians["none"]
    results = {
        "burn_us": args.burn_us,
        "period_ms": args.period_ms,
        "output_tokens": args.output_tokens,
        "tok_s": tok_s,
        "median_tok_s": medians,
        "helper_share": helper_share,
    }
    print(f"worker alone {medians['none']:.1f} tok/s, on one thread {medians['one thread']:.1f}: the helpers' share of the step {helper_share:.2f}")
    for name in burners:
        loss = results[f"burner {name}"] = loss_per_burn(medians["none"], medians[name], args.burn_us, period_s)
        print(
            f"burner {args.burn_us:g} us per {args.period_ms:g} ms, {name}: {medians[name]:.1f} tok/s ({medians[name] / medians['none']:.3f}), "
            f"{loss['extra_ms_per_token']:.3f} ms more per token for {loss['burn_ms_per_token']:.3f} ms of burn: u {loss['u']:.2f}"
        )
    write_results(args.out, results)


if __name__ == "__main__":
    main()
