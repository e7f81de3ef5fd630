"""Decode throughput through the whole stack against the worker alone, interleaved in one run.

Workload: prompts of a few dozen tokens, ``--output-tokens`` each with ignore_eos, greedy;
with one stream and with ``--concurrency`` streams. The same workload also runs in-process:
the scheduler's state machine driving a ModelRunner directly (the stack's settings), with no
sockets and no processes. The ratio stack / in-process is what the four-process design costs
(or, thanks to pipelining, saves).

This machine's speed drifts by tens of percent within minutes, so one stack run followed by
one in-process run measures the drift as much as the design. The two are interleaved instead:
``--rounds`` rounds, each running both at each stream count, the order reversed every other
round; the report gives each round's ratio, the median over rounds and the paired median: the
median over pairs of rounds of each pair's geometric mean. Where a run's speed depends on its
place in the round, the rounds' ratios alternate and their median rests on the odd rounds or the
even ones; the paired median cancels that. (On a 2-core Xeon with a 300 MB L3, 1-stream rounds
alternate between ~1.04 and ~0.90: a 1-stream run reads up to 10 % faster as a round's first than
as its second, whichever system it is, and a warm-up run before each does not change that.)

    python -m bench.stack_throughput [--url http://127.0.0.1:8000] [--output-tokens 128] [--concurrency 8] [--rounds 3]

Without --url it starts its own stack on a free port and stops it afterwards. The in-process
runner loads beside the running stack (whose worker idles meanwhile), so both are warm.

The client: the stack's processes, not the benchmark's client, are what the ratio judges, and a real client
runs on another machine. Here it shares the stack's two cores, and each of its wake-ups is taken from the
worker's. ``--client-sched idle`` runs the client's thread under SCHED_IDLE during the stack's runs, so that
it takes only CPU that no process of the stack wants; ``normal`` (the default) runs it as an ordinary thread.
The two read the same within the rounds' spread (docs/performance.md). Its CPU shows either way.

Where the stack's difference goes: each stack run also records the CPU time per output token of
every process (all its threads, ZMQ's included) and of the benchmark itself (the client, which
shares the machine's cores with the stack but not with the in-process runner; a lean one,
shared/devtools/sse.py, that costs about half of aiohttp's reader per token). Where the worker
alone fills every core (a CPU worker at one stream), the others' CPU comes out of the worker's, so
stack / worker tends to the worker's share of the total, which the report prints beside it. It
also prints each process's wake-ups per token and what one wake-up costs this machine
(bench.wake_cost): one stream wakes every process at least once per token; and each one's CPU split into
user and kernel time (10 ms ticks, summed over the rounds), which tells its Python from its sockets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import math
import os
import platform
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from statistics import median
from typing import TypeVar

from bench import wake_cost
from bench.report import percentile, write_results
from services.scheduler.core import Scheduler
from services.scheduler.kv_blocks import BlockPool
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.devtools.inprocess_engine import InProcessEngine
from shared.devtools.sse import stream_chat
from shared.devtools.stack import running_stack, served_model
from shared.frames import SamplingParams, Submit
from shared.model_info import kv_cache_blocks, load_model_info

T = TypeVar("T")
_libc = ctypes.CDLL(None)  # clock_getcpuclockid, which the time module does not wrap

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten year old.",
    "List some ideas for a weekend trip in the mountains and what to pack.",
    "Describe the water cycle in detail.",
    "What are the pros and cons of working from home?",
    "Write a poem about the sea at night.",
    "Summarize the plot of a detective novel you invent.",
    "Give advice to someone learning to cook for the first time.",
]


CLIENT_POLICIES = {"idle": os.SCHED_IDLE, "normal": os.SCHED_OTHER}


def paired_ratio(ratios: list[float]) -> float | None:
    """The median over rounds 1-2, 3-4, ... of each pair's geometric mean (None below two rounds; an odd last
    round is left out). The two rounds of a pair run the systems in opposite orders, so whatever a run owes
    to its place in the round (the run before it, the machine's state) cancels within the pair."""
    pairs = [math.sqrt(a * b) for a, b in zip(ratios[0::2], ratios[1::2], strict=False)]
    return median(pairs) if pairs else None


def run_as_client(policy: str, work: Callable[[], T]) -> T:
    """``work()`` on a thread of its own under this scheduling policy (``CLIENT_POLICIES``): a thread that
    ends, so that nothing has to be set back (leaving SCHED_IDLE may need a privilege). Threads it starts
    (asyncio's resolver) inherit the policy."""
    # pid 0: the calling thread, here the pool's one thread
    with ThreadPoolExecutor(max_workers=1, initializer=os.sched_setscheduler, initargs=(0, CLIENT_POLICIES[policy], os.sched_param(0))) as pool:
        return pool.submit(work).result()


async def _stack_run(url: str, model: str, concurrency: int, output_tokens: int, pids: dict[str, int]) -> dict:
    # The lean client (shared/devtools/sse.py): its CPU shares the cores with the stack, not with the in-process run.
    await stream_chat(url, model, [{"role": "user", "content": "Hello"}], 8)  # warm-up, not counted
    cpu_before, wakes_before, split_before = _cpu_seconds(pids), _wake_ups(pids), _user_system(pids)
    started = time.perf_counter()
    runs = await asyncio.gather(*(stream_chat(url, model, [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], output_tokens) for i in range(concurrency)))
    wall = time.perf_counter() - started
    cpu_after, wakes_after, split_after = _cpu_seconds(pids), _wake_ups(pids), _user_system(pids)
    tokens = sum(r.usage.get("completion_tokens", 0) for r in runs)
    return {
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "cpu_ms_per_token": {name: 1000 * (cpu_after[name] - cpu_before[name]) / max(tokens, 1) for name in cpu_before},
        "wake_ups_per_token": {name: (wakes_after[name] - wakes_before[name]) / max(tokens, 1) for name in wakes_before},
        "user_system_s": {name: [a - b for a, b in zip(split_after[name], split_before[name])] for name in split_before},
        "ttft_p50_s": percentile([r.chunk_times[0] - r.start for r in runs if r.chunk_times], 50),
        "itl_p50_s": percentile([b - a for r in runs for a, b in zip(r.chunk_times, r.chunk_times[1:])], 50),
    }


def in_process_run(concurrency: int, output_tokens: int, runner, tokenizer, scheduler: Scheduler, pipeline_depth: int) -> dict:
    """The same workload through the scheduler core and the runner in one process."""
    submits = []
    for i in range(concurrency):
        text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        submits.append(Submit(rid=f"bench-{i}", prompt_ids=prompt_ids, max_tokens=output_tokens, sampling=SamplingParams(temperature=0), ignore_eos=True))
    cpu_before = process_cpu_seconds(os.getpid())
    run = InProcessEngine(scheduler, runner, pipeline_depth).run(submits)
    cpu = process_cpu_seconds(os.getpid()) - cpu_before
    return {
        "output_tokens": run.output_tokens,
        "wall_s": run.wall_s,
        "output_tok_s": run.output_tokens / run.wall_s,
        "steps": run.steps,
        "cpu_ms_per_token": 1000 * cpu / max(run.output_tokens, 1),
    }


def process_cpu_seconds(pid: int) -> float:
    """CPU time of a process so far, every thread included, ended ones too: its POSIX CPU-time clock, in
    nanoseconds (``/proc/PID/stat`` counts 10 ms ticks, too coarse for a run of a second; summing
    ``/proc/PID/task/*/schedstat`` loses the threads that ended)."""
    clock = ctypes.c_int()
    error = _libc.clock_getcpuclockid(pid, ctypes.byref(clock))
    if error:
        raise OSError(error, f"no CPU clock for process {pid}: {os.strerror(error)}")
    return time.clock_gettime(clock.value)


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """Each stack process's CPU time, and this process's as "client": during a stack run this process
    only drives the requests (the in-process runner's threads wait)."""
    return {**{name: process_cpu_seconds(pid) for name, pid in pids.items()}, "client": process_cpu_seconds(os.getpid())}


_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def user_system_seconds(pid: int) -> tuple[float, float]:
    """A process's CPU time so far in user and in kernel mode (``/proc/PID/stat``'s utime and stime: 10 ms
    ticks, so summed over a benchmark's rounds rather than read per run)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[11]) * _TICK_S, int(fields[12]) * _TICK_S


def _user_system(pids: dict[str, int]) -> dict[str, tuple[float, float]]:
    """Each stack process's user and kernel CPU so far, and this process's as "client" (as _cpu_seconds)."""
    return {**{name: user_system_seconds(pid) for name, pid in pids.items()}, "client": user_system_seconds(os.getpid())}


def voluntary_switches(pid: int) -> int:
    """How often the process's live threads went to sleep (each sleep ends in a wake-up): the sum of
    ``voluntary_ctxt_switches`` over /proc/PID/task/*/status. Threads that ended are not counted."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:"))
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return total


def _wake_ups(pids: dict[str, int]) -> dict[str, int]:
    """Each stack process's wake-ups so far, and this process's as "client" (as _cpu_seconds)."""
    return {**{name: voluntary_switches(pid) for name, pid in pids.items()}, "client": voluntary_switches(os.getpid())}


def _pids(url: str) -> dict[str, int]:
    """Each process's pid, from its /instrumentation (the metrics ports follow the api port); no detokenizer
    where the api detokenizes (``--detokenize-in api``)."""
    port = int(url.rsplit(":", 1)[1])
    pids = {}
    for offset, name in enumerate(("api", "scheduler", "worker", "detokenizer")):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port + offset}/instrumentation") as response:
                pids[name] = json.load(response)["pid"]
        except urllib.error.URLError:
            if name != "detokenizer":
                raise
    return pids


class _PeakRss:
    """Samples each process's RSS every 50 ms in a thread and keeps the maximum."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.peak = dict.fromkeys(pids, 0.0)
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running:
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], _rss_mb(pid))
            time.sleep(0.05)

    def stop(self) -> dict[str, float]:
        self.running = False
        self.thread.join()
        return {name: round(value, 1) for name, value in self.peak.items()}


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def in_process_runner(model: str, flags: list[str]):
    """A warm ModelRunner, the tokenizer, and a scheduler core with the stack's settings. The core serves
    every in-process run, so its prefix cache warms over the rounds as the stack's does."""
    import torch

    from services.worker.runner import ModelRunner, RunnerConfig  # torch: imported only for the in-process half
    from shared.tokenizer import load_tokenizer

    config = StackConfig.from_argv(["--model", model, *flags])
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    num_blocks = kv_cache_blocks(load_model_info(model), config.kv_cache_tokens, config.kv_cache_bytes, config.block_size, config.dtype)
    runner = ModelRunner(RunnerConfig.of(config, num_blocks))
    runner.warmup()

    pool = BlockPool(runner.num_blocks, runner.block_size, config.enable_prefix_cache)
    scheduler = Scheduler(
        pool,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        config.max_waiting,
        mixed_step_target_s=config.mixed_step_target_ms / 1000,
        decode_plan_s=config.decode_plan_ms / 1000,
    )
    return runner, load_tokenizer(model), scheduler, config.pipeline_depth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="", help="an already running stack (default: start one)")
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of stack and in-process runs")
    parser.add_argument("--out", default="bench/results/stack_throughput.json")
    parser.add_argument("--stack-flag", action="append", default=[], help="a flag for the started stack, e.g. --stack-flag=--dtype=bfloat16")
    parser.add_argument(
        "--client-sched", choices=sorted(CLIENT_POLICIES), default="normal", help="the client's scheduling policy during stack runs (see above)"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    levels = sorted({1, args.concurrency})  # one stream, and --concurrency streams (once, when that is 1 too)
    wake_costs = wake_cost.measure()  # before the stack starts (one given by --url idles meanwhile)
    results: dict = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "output_tokens": args.output_tokens,
        "stack_flags": args.stack_flag,
        "client_sched": args.client_sched,
        "wake_cpu_us": wake_costs,
        "rounds": [],
    }
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(running_stack(args.model, *args.stack_flag))
        model_id = served_model(url)
        pids = _pids(url)
        results["rss_mb_idle"] = {name: round(_rss_mb(pid), 1) for name, pid in pids.items()}
        runner, tokenizer, scheduler, depth = in_process_runner(args.model, args.stack_flag)
        peak = _PeakRss(pids)
        for index in range(args.rounds):
            round_results: dict = {}
            for n in levels:
                runs = {
                    "stack": lambda n=n: run_as_client(args.client_sched, lambda: asyncio.run(_stack_run(url, model_id, n, args.output_tokens, pids))),
                    "worker": lambda n=n: in_process_run(n, args.output_tokens, runner, tokenizer, scheduler, depth),
                }
                for name in ("stack", "worker") if index % 2 == 0 else ("worker", "stack"):
                    round_results[f"{name}_{n}"] = runs[name]()
                round_results[f"ratio_{n}"] = round_results[f"stack_{n}"]["output_tok_s"] / round_results[f"worker_{n}"]["output_tok_s"]
            results["rounds"].append(round_results)
            print(f"round {index + 1}: " + ", ".join(f"{n} stream(s) stack / worker {round_results[f'ratio_{n}']:.3f}" for n in levels), flush=True)
        results["rss_mb_peak_under_load"] = peak.stop()

    rounds = results["rounds"]
    results["median"] = {f"{name}_{n}_output_tok_s": median([r[f"{name}_{n}"]["output_tok_s"] for r in rounds]) for n in levels for name in ("stack", "worker")}
    results["median"].update({f"ratio_{n}": median([r[f"ratio_{n}"] for r in rounds]) for n in levels})
    results["median"].update({f"ratio_{n}_paired": paired_ratio([r[f"ratio_{n}"] for r in rounds]) for n in levels})
    print(
        f"{'workload':<24}{'stack tok/s':>14}{'worker alone tok/s':>22}{'stack / worker':>18}{'paired':>10}"
        f"   (medians of {len(rounds)} rounds; paired: of each two rounds' geometric mean, which cancels the order)"
    )
    for n in levels:
        m = results["median"]
        paired = m[f"ratio_{n}_paired"]
        print(
            f"{f'{n} stream(s) x {args.output_tokens}':<24}{m[f'stack_{n}_output_tok_s']:>14.1f}{m[f'worker_{n}_output_tok_s']:>22.1f}{m[f'ratio_{n}']:>18.3f}"
            + (f"{paired:>10.3f}" if paired is not None else f"{'-':>10}")
        )
        per_round = ", ".join(f"{r[f'ratio_{n}']:.3f}" for r in rounds)
        print(f"{'':<24}per round: {per_round}")
    for n in levels:
        stacks = [r[f"stack_{n}"] for r in rounds]
        ttft, itl = median([s["ttft_p50_s"] for s in stacks]), median([s["itl_p50_s"] for s in stacks])
        print(f"stack, {n} stream(s): TTFT p50 {ttft * 1000:.0f} ms, ITL p50 {itl * 1000:.1f} ms (medians over rounds)")
        cpu = {name: median([s["cpu_ms_per_token"][name] for s in stacks]) for name in stacks[0]["cpu_ms_per_token"]}
        results["median"][f"stack_{n}_cpu_ms_per_token"] = cpu
        print(f"stack, {n} stream(s): CPU ms per output token (medians over rounds):", ", ".join(f"{name} {ms:.3f}" for name, ms in cpu.items()))
        share = results["median"][f"stack_{n}_worker_cpu_share"] = cpu["worker"] / sum(cpu.values())
        print(f"stack, {n} stream(s): the worker's share of that CPU {share:.3f} (where the worker fills the cores, the ratio it leaves)")
        alone = results["median"][f"worker_{n}_cpu_ms_per_token"] = median([r[f"worker_{n}"]["cpu_ms_per_token"] for r in rounds])
        print(f"worker alone, {n} stream(s): CPU ms per output token {alone:.3f} (the stack's worker: {cpu['worker']:.3f})")
        tokens = sum(s["output_tokens"] for s in stacks)
        split = {name: [1000 * sum(s["user_system_s"][name][mode] for s in stacks) / max(tokens, 1) for mode in (0, 1)] for name in stacks[0]["user_system_s"]}
        results.setdefault("all_rounds", {})[f"stack_{n}_user_system_ms_per_token"] = split  # ticks: a sum, not a median
        print(
            f"stack, {n} stream(s): user / kernel CPU ms per output token (all rounds together):",
            ", ".join(f"{name} {user:.3f} / {kernel:.3f}" for name, (user, kernel) in split.items()),
        )
        wakes = {name: median([s["wake_ups_per_token"][name] for s in stacks]) for name in stacks[0]["wake_ups_per_token"]}
        results["median"][f"stack_{n}_wake_ups_per_token"] = wakes
        print(f"stack, {n} stream(s): wake-ups per output token (medians over rounds):", ", ".join(f"{name} {w:.2f}" for name, w in wakes.items()))
    costs = results["wake_cpu_us"]
    print(
        f"this machine: a sleeping process's wake-up costs {costs['idle_core_us']:.0f} us of CPU on an idle core, "
        f"{costs['streaming_core_us']:.0f} us on a core that streams memory (bench.wake_cost)"
    )
    print("RSS idle after load (MB):", results["rss_mb_idle"])
    print("RSS peak under load (MB):", results["rss_mb_peak_under_load"])
    write_results(args.out, results)


if __name__ == "__main__":
    main()
