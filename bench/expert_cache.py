"""The expert cache against the physical bound: the MoE benchmark model (``bench.moe_model``) with its experts in
int4 blocks, driven in-process (one ``ModelRunner`` per setting, the stack's worker settings), greedy decoding of
``--max-tokens`` a stream (ignoring EOS) at concurrency 1 and 8, with everything resident and with the expert cache
at 100 / 50 / 25 / 12.5 % of the experts' size under each ``--policy``, ``--fills`` and ``--prefetch`` setting listed, the
settings taking turns round by round.

    .venv/bin/python -m bench.expert_cache [--model DIR] [--shape a135m|tiny] [--rounds 2] [--max-tokens 64] [--policy lru lfu] \\
        [--fills on-demand auto] [--prefetch on off] [--skewed [--hot-model DIR] [--hot-experts 16] [--hot-bias 3]] [--cache-dir DIR] [--out bench/results/expert_cache.json]

Per setting and concurrency it prints output tokens/s and its ratio to all-resident, and over the decode steps the
cache's hit rate, bytes read and fill time per output token (the cache's own counters), the decode step time against
the bound ``all-resident step + missed bytes / storage read bandwidth`` (over the rounds' medians, and round by round
against that round's bandwidth: the storage's rate drifts), the miss path's own read rate, and whether
the tokens are those of the all-resident run. The storage's read bandwidth is measured each round by reading the
expert store file sequentially in 4 MiB reads with the page cache bypassed (O_DIRECT, else buffered reads after and
behind ``posix_fadvise(DONTNEED)``; the report says which; the better of one and four reads in flight), and at the miss path's size: one expert's record at a
time in random order, and as many side by side as the miss path reads a layer-step's misses (its share of that
too: what the storage gives a few random records at once). ``--skewed`` runs the same table on a model whose routers favour
``--hot-experts`` experts per layer and prints what that gains in hit rate.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from prometheus_client import REGISTRY

from bench.moe_model import SHAPES, MoeSpec, calibration_text, write_hf
from bench.report import write_results
from services.worker.expert_cache import ALIGN, POLICIES, ExpertStore, aligned_buffer
from services.worker.expert_reads import READERS, StoreReads
from services.worker.runner import ModelRunner, RunnerConfig
from shared.choices import EXPERT_CACHE_FILLS, EXPERT_CACHE_PREFETCH
from shared.config import StackConfig
from shared.frames import SamplingParams, Slice, StepPlan
from shared.metrics import PREFIX
from shared.tokenizer import load_tokenizer

RATIOS = (100.0, 50.0, 25.0, 12.5)  # percent of the experts' size; 0 (all resident) is the baseline
CONCURRENCIES = (1, 8)
CHUNK = 4 << 20
FILL_SECONDS = f"{PREFIX}expert_cache_fill_seconds_sum"


class Setting(NamedTuple):
    percent: float  # of the experts' size; 0: all resident
    policy: str  # the expert cache's --expert-cache-policy ("" when all resident)
    fill: str = ""  # its --expert-cache-fill ("" when all resident)
    prefetch: str = ""  # its --expert-cache-prefetch ("" when all resident)

    def __str__(self) -> str:
        return f"{self.percent:g}% {self.policy} {self.fill} prefetch {self.prefetch}" if self.percent else "0"

    @property
    def tag(self) -> str:
        return f"{self.percent:g}-{self.policy}-{self.fill}-{self.prefetch}"


@dataclass
class Totals:
    """One setting's timed runs at one concurrency; the counters over the decode steps only."""

    seconds: list[float] = field(default_factory=list)  # prefill + decode, a run each
    step_seconds: list[float] = field(default_factory=list)  # decode time / decode steps, a run each
    missed_per_step: list[float] = field(default_factory=list)  # routed experts not held before their layer-step, a run each
    decode_steps: int = 0
    decode_tokens: int = 0
    hits: int = 0
    misses: int = 0
    read_ahead_used: int = 0  # experts read ahead that their layer-step routed to
    read_ahead_unused: int = 0
    bytes_read: int = 0
    fill_seconds: float = 0.0
    outputs: list[dict[str, list[int]]] = field(default_factory=list)


def counters(runner: ModelRunner) -> tuple[int, int, int, int, int, float]:
    """(hits, misses, experts read ahead used and unused, bytes read, fill seconds) of ``runner``'s expert cache so far;
    zeros without one."""
    cache = runner.expert_cache
    if cache is None:
        return 0, 0, 0, 0, 0, 0.0
    described = cache.describe()  # what /instrumentation shows
    ahead = described["prefetched"]
    return described["hits"], described["misses"], ahead["used"], ahead["unused"], described["bytes_read"], REGISTRY.get_sample_value(FILL_SECONDS) or 0.0


def chat_prompts(model: str) -> list[list[int]]:
    """The chat workload's prompts, templated: one a stream, so that streams route differently."""
    tokenizer = load_tokenizer(model)
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for text in calibration_text(n_prompts=1 << 10)
    ]


def decode_batch(runner: ModelRunner, tag: str, prompts: list[list[int]], max_tokens: int, totals: Totals | None = None) -> None:
    """Prefills ``prompts`` (a stream each, one per step) and decodes ``max_tokens`` tokens each as one batch, greedy;
    adds the run to ``totals`` when given."""
    per = -(-(max(map(len, prompts)) + max_tokens + 1) // runner.block_size)
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    outputs: dict[str, list[int]] = {rid: [] for rid in rids}
    greedy = SamplingParams(temperature=0)
    began = time.perf_counter()
    for i, (rid, prompt) in enumerate(zip(rids, prompts)):
        for s in runner.execute(StepPlan(0, [Slice(rid, 0, len(prompt), prompt, list(range(i * per, (i + 1) * per)), sampling=greedy)])).sampled:
            outputs[s.rid].append(s.token_id)
    before, decoding = counters(runner), time.perf_counter()
    for step in range(max_tokens - 1):
        for s in runner.execute(StepPlan(step + 1, [Slice(rid, len(prompt) + step, 1) for rid, prompt in zip(rids, prompts)])).sampled:
            outputs[s.rid].append(s.token_id)
    ended, after = time.perf_counter(), counters(runner)
    runner.release(rids)
    if totals is None:
        return
    steps = max(max_tokens - 1, 1)
    totals.seconds.append(ended - began)
    totals.step_seconds.append((ended - decoding) / steps)
    totals.decode_steps += max_tokens - 1
    totals.decode_tokens += (max_tokens - 1) * len(prompts)
    hits, misses, used, unused, read, fill = (b - a for a, b in zip(before, after))
    totals.hits += hits
    totals.misses += misses
    totals.read_ahead_used += used
    totals.read_ahead_unused += unused
    totals.missed_per_step.append((misses + used) / steps)
    totals.bytes_read += read
    totals.fill_seconds += fill
    totals.outputs.append({rid.rsplit("-", 1)[1]: tokens for rid, tokens in outputs.items()})


def _reader(store: ExpertStore) -> tuple[int, bool]:
    """A descriptor of ``store``'s (unlinked) file opened with O_DIRECT where the filesystem allows, and whether it is."""
    path = f"/proc/self/fd/{store.fd}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return os.open(path, os.O_RDONLY), False
    try:
        os.preadv(fd, [mmap.mmap(-1, ALIGN)], 0)
    except OSError:
        os.close(fd)
        return os.open(path, os.O_RDONLY), False
    return fd, True


def read_bandwidth(store: ExpertStore) -> tuple[float, float, float, str]:
    """(sequential bytes/s in CHUNK reads: the better of one in flight, as ``dd``, and ``READERS`` in flight the way the
    cache reads, as ``fio`` at that queue depth; bytes/s of one record a read in random order; bytes/s of random
    records read ``READERS`` side by side; how the page cache was bypassed) over ``store``'s file: the storage's read
    bandwidth, measured on the very file the cache reads."""
    fd, direct = _reader(store)
    how = "O_DIRECT" if direct else "buffered reads after posix_fadvise(DONTNEED), each followed by DONTNEED"

    def read(index: int, buffer: mmap.mmap, size: int = store.record) -> int:
        read_now = os.preadv(fd, [buffer], index * size)
        if not direct:
            os.posix_fadvise(fd, index * size, size, os.POSIX_FADV_DONTNEED)
        return read_now

    def sequential() -> float:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buffer, offset = mmap.mmap(-1, CHUNK), 0
        began = time.perf_counter()
        while offset < store.nbytes and (read_now := read(offset // CHUNK, buffer, CHUNK)) > 0:
            offset += read_now
        return offset / (time.perf_counter() - began)

    try:
        best_sequential = max(sequential(), sequential_as_the_cache_reads(store))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        records = list(range(store.num_layers * store.num_experts))
        random.Random(0).shuffle(records)
        records = records[: max(1, min(len(records), (64 << 20) // store.record))]
        buffers = [mmap.mmap(-1, store.record) for _ in range(READERS)]
        began = time.perf_counter()
        for index in records:
            read(index, buffers[0])
        per_record = len(records) * store.record / (time.perf_counter() - began)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with ThreadPoolExecutor(READERS) as readers:
            began = time.perf_counter()
            for first in range(0, len(records), READERS):
                group = records[first : first + READERS]
                for future in [readers.submit(read, index, buffer) for index, buffer in zip(group, buffers)]:
                    future.result()
            side_by_side = len(records) * store.record / (time.perf_counter() - began)
    finally:
        os.close(fd)
    return best_sequential, per_record, side_by_side, how


def sequential_as_the_cache_reads(store: ExpertStore) -> float:
    """Bytes/s of the store read from end to end in CHUNK reads, ``READERS`` in flight, the way the cache reads
    (``StoreReads``: native AIO where the store reads with O_DIRECT)."""
    reads = StoreReads.of(store)
    per_read = max(1, min(store.num_experts, CHUNK // store.record))
    bank = torch.frombuffer(aligned_buffer(READERS * per_read * store.record), dtype=torch.uint8).view(READERS * per_read, store.record)
    reads.bank(bank)
    spans = [(layer, first) for layer in range(store.num_layers) for first in range(0, store.num_experts, per_read)]
    in_flight: list[Any] = []
    began, total = time.perf_counter(), 0
    for n, (layer, first) in enumerate(spans):
        if len(in_flight) == READERS:
            total += reads.wait(in_flight.pop(0))[0]
        lane = n % READERS
        in_flight += reads.start([(layer, first, list(range(lane * per_read, lane * per_read + min(per_read, store.num_experts - first))))])
    total += sum(reads.wait(read)[0] for read in in_flight)
    return total / (time.perf_counter() - began)


def load_runners(model: str, args: argparse.Namespace, blocks: int) -> dict[Setting, ModelRunner]:
    """A warmed runner per setting (0: all resident), each with its own store and bank, as a worker launched with it."""
    runners = {}
    settings = (Setting(ratio, policy, fill, prefetch) for ratio in RATIOS for policy in args.policy for fill in args.fills for prefetch in args.prefetch)
    for setting in [Setting(0.0, ""), *settings]:
        config = StackConfig(
            model=model,
            weight_quant=args.weight_quant,
            expert_cache_bytes=f"{setting.percent:g}%" if setting.percent else "0",
            expert_cache_dir=args.cache_dir,
            expert_cache_policy=setting.policy or StackConfig().expert_cache_policy,
            expert_cache_fill=setting.fill or StackConfig().expert_cache_fill,
            expert_cache_prefetch=setting.prefetch or StackConfig().expert_cache_prefetch,
        )
        runners[setting] = runner = ModelRunner(RunnerConfig.of(config, num_blocks=blocks))
        runner.warmup()
    return runners


def bench_model(model: str, args: argparse.Namespace, label: str) -> dict[str, Any]:
    """The table of one model: every setting at every concurrency, the rounds taking turns; returns its summary."""
    prompts = chat_prompts(model)
    blocks = max(CONCURRENCIES) * (-(-(max(map(len, prompts)) + args.max_tokens + 1) // StackConfig().block_size)) + 8
    runners = load_runners(model, args, blocks)
    cache = runners[Setting(RATIOS[0], args.policy[0], args.fills[0], args.prefetch[0])].expert_cache
    assert cache is not None
    described = cache.describe()
    print(
        f"{label}: {model}, {cache.experts} experts ({described['formats']}, {cache.slot_bytes} bytes each, "
        f"{cache.experts * cache.slot_bytes / 1e6:.1f} MB), store reads {described['store_reads']}, fill policy {described['fill_policy']}, "
        f"policies {' '.join(args.policy)}",
        flush=True,
    )
    warm = prompts[-max(CONCURRENCIES) :]
    for setting, runner in runners.items():  # each cache in its steady state before the first timed run
        decode_batch(runner, f"warm-{setting.tag}", warm, max(4, args.max_tokens // 4))
    totals = {(setting, c): Totals() for setting in runners for c in CONCURRENCIES}
    bandwidths: list[tuple[float, float, float]] = []
    how = ""
    for round_ in range(args.rounds):
        *bandwidth, how = read_bandwidth(cache.store)
        bandwidths.append(tuple(bandwidth))
        for offset, concurrency in enumerate(CONCURRENCIES):
            first = (round_ * sum(CONCURRENCIES) + offset * CONCURRENCIES[0]) % len(prompts)
            batch = [prompts[(first + i) % len(prompts)] for i in range(concurrency)]
            for setting, runner in runners.items():
                decode_batch(
                    runner,
                    f"r{round_}-c{concurrency}-{setting.tag}",
                    batch,
                    args.max_tokens,
                    totals[(setting, concurrency)],
                )
    sequential = statistics.median(b[0] for b in bandwidths)
    per_record = statistics.median(b[1] for b in bandwidths)
    side_by_side = statistics.median(b[2] for b in bandwidths)
    print(
        f"storage read bandwidth ({how}): {sequential / 1e9:.2f} GB/s sequential in {CHUNK >> 20} MiB reads (1 or {READERS} in flight), "
        f"{per_record / 1e9:.2f} GB/s a record ({cache.store.record} bytes) at a time, {side_by_side / 1e9:.2f} GB/s {READERS} records "
        "side by side; rounds: " + ", ".join(f"{s / 1e9:.2f}/{r / 1e9:.2f}/{b / 1e9:.2f}" for s, r, b in bandwidths),
        flush=True,
    )
    header = (
        f"{'c':>2} {'cache':>6} {'policy':>6} {'fill':>9} {'ahead':>5} {'tok/s':>8} {'vs 0':>5} {'hit rate':>8} {'ahead used':>10} {'KB read/tok':>11} {'fill ms/tok':>11} "
        f"{'step ms':>8} {'bound ms':>8} {'step/bound':>10} {'by round':>11} {'miss GB/s':>9} {'of bw':>6} {'of 4x':>6} {'same tokens':>11}"
    )
    print(header)
    rows = []
    for concurrency in CONCURRENCIES:
        base = totals[(Setting(0.0, ""), concurrency)]
        base_rate = concurrency * args.max_tokens / statistics.median(base.seconds)
        base_step = statistics.median(base.step_seconds)
        for setting in runners:
            t = totals[(setting, concurrency)]
            rate = concurrency * args.max_tokens / statistics.median(t.seconds)
            step = statistics.median(t.step_seconds)
            lookups = t.hits + t.misses + t.read_ahead_used
            missed_bytes = (t.misses + t.read_ahead_used) * cache.slot_bytes  # routed experts not held before their step predicted them
            bound = base_step + missed_bytes / max(t.decode_steps, 1) / sequential
            # each round against its own bandwidth and resident step: the storage's rate drifts between rounds
            per_round = [
                step_r / (base_r + missed * cache.slot_bytes / rate[0])
                for step_r, base_r, missed, rate in zip(t.step_seconds, base.step_seconds, t.missed_per_step, bandwidths)
            ]
            ahead = t.read_ahead_used + t.read_ahead_unused
            miss_rate = t.bytes_read / t.fill_seconds if t.bytes_read and t.fill_seconds else None
            row = {
                "concurrency": concurrency,
                "cache_percent": setting.percent,
                "policy": setting.policy,
                "fill": setting.fill,
                "prefetch": setting.prefetch,
                "cache_bytes": runners[setting].expert_cache.budget if setting.percent else 0,
                "output_tokens_per_s": rate,
                "vs_resident": rate / base_rate,
                "hit_rate": t.hits / lookups if lookups else None,
                "hits": t.hits,
                "misses": t.misses,
                "read_ahead_used": t.read_ahead_used,
                "read_ahead_unused": t.read_ahead_unused,
                "bytes_read_per_token": t.bytes_read / max(t.decode_tokens, 1),
                "fill_ms_per_token": t.fill_seconds / max(t.decode_tokens, 1) * 1e3,
                "step_ms": step * 1e3,
                "bound_ms": bound * 1e3,
                "step_over_bound": step / bound,
                "step_over_bound_by_round": per_round,
                "miss_path_bytes_per_s": miss_rate,
                "miss_path_share_of_bandwidth": miss_rate / sequential if miss_rate else None,
                "miss_path_share_of_side_by_side": miss_rate / side_by_side if miss_rate else None,
                "same_tokens_as_resident": t.outputs == base.outputs,
                "run_seconds": t.seconds,
                "step_seconds": t.step_seconds,
            }
            rows.append(row)
            hit = f"{row['hit_rate']:.3f}" if row["hit_rate"] is not None else "-"
            used = f"{t.read_ahead_used / ahead:.3f}" if ahead else "-"
            miss = f"{miss_rate / 1e9:>9.2f} {miss_rate / sequential:>6.2f} {miss_rate / side_by_side:>6.2f}" if miss_rate else f"{'-':>9} {'-':>6} {'-':>6}"
            print(
                f"{concurrency:>2} {f'{setting.percent:g}%' if setting.percent else '0':>6} {setting.policy or '-':>6} {setting.fill or '-':>9} "
                f"{setting.prefetch or '-':>5} {rate:>8.1f} {rate / base_rate:>5.2f} {hit:>8} {used:>10} "
                f"{row['bytes_read_per_token'] / 1e3:>11.1f} {row['fill_ms_per_token']:>11.3f} {step * 1e3:>8.2f} {bound * 1e3:>8.2f} "
                f"{step / bound:>10.2f} {'/'.join(f'{r:.2f}' for r in per_round):>11} {miss} {str(row['same_tokens_as_resident']):>11}",
                flush=True,
            )
    return {
        "model": model,
        "experts": cache.experts,
        "slot_bytes": cache.slot_bytes,
        "formats": described["formats"],
        "store_reads": described["store_reads"],
        "fill_policy": described["fill_policy"],
        "bandwidth": {
            "method": how,
            "sequential_bytes_per_s": sequential,
            "record_bytes_per_s": per_record,
            "side_by_side_bytes_per_s": side_by_side,
            "rounds": bandwidths,
        },
        "rows": rows,
    }


def build_model(directory: str, spec: MoeSpec) -> str:
    path = os.path.join(directory, f"moe-bench-{spec.shape}" + (f"-hot{spec.hot_experts}" if spec.hot_experts else ""))
    record = write_hf(path, spec)
    print(f"built {path}" + (f" (hot share {record['hot_share']:.2f})" if spec.hot_experts else ""), flush=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="the MoE benchmark model's HF directory (default: built by bench.moe_model into a temporary one)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="a135m", help="the shape of a model built here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-quant", default="int4", help="--weight-quant of the worker (experts in blocks)")
    parser.add_argument("--cache-dir", default="", help="--expert-cache-dir (default: the worker's)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--policy", nargs="+", choices=sorted(POLICIES), default=[StackConfig().expert_cache_policy], help="expert cache policies, each at every size"
    )
    parser.add_argument(
        "--fills", nargs="+", choices=EXPERT_CACHE_FILLS, default=[StackConfig().expert_cache_fill], help="--expert-cache-fill settings, each at every size"
    )
    parser.add_argument(
        "--prefetch",
        nargs="+",
        choices=EXPERT_CACHE_PREFETCH,
        default=[StackConfig().expert_cache_prefetch],
        help="--expert-cache-prefetch settings, each at every size",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skewed", action="store_true", help="also run a model whose routers favour a subset of experts")
    parser.add_argument("--hot-model", default="", help="the skewed model's directory (default: built here)")
    parser.add_argument("--hot-experts", type=int, default=16, help="experts per layer the skewed routers favour")
    parser.add_argument("--hot-bias", type=float, default=3.0, help="router logit added to the hot experts, on average")
    parser.add_argument("--out", default="bench/results/expert_cache.json")
    args = parser.parse_args(argv)
    summary: dict[str, Any] = {"args": vars(args), "concurrencies": CONCURRENCIES, "cache_percents": RATIOS}
    with tempfile.TemporaryDirectory(prefix="expert-cache-bench-") as scratch:
        model = args.model or build_model(scratch, MoeSpec(args.shape, args.seed))
        summary["uniform"] = bench_model(model, args, "uniform routing")
        if args.skewed:
            hot = args.hot_model or build_model(scratch, MoeSpec(args.shape, args.seed, args.hot_experts, args.hot_bias))
            summary["skewed"] = skewed = bench_model(hot, args, f"skewed routing ({args.hot_experts} hot experts a layer, bias {args.hot_bias:g})")
            print(f"{'c':>2} {'cache':>6} {'policy':>6} {'uniform hit':>11} {'skewed hit':>10} {'gain':>6} {'tok/s skewed/uniform':>21}")
            gains = []
            for u, s in zip(summary["uniform"]["rows"], skewed["rows"]):
                if not u["cache_percent"]:
                    continue
                gain = {
                    "concurrency": u["concurrency"],
                    "cache_percent": u["cache_percent"],
                    "policy": u["policy"],
                    "uniform_hit_rate": u["hit_rate"],
                    "skewed_hit_rate": s["hit_rate"],
                }
                gain["hit_rate_gain"] = s["hit_rate"] - u["hit_rate"]
                gain["tokens_per_s_ratio"] = s["output_tokens_per_s"] / u["output_tokens_per_s"]
                gains.append(gain)
                print(
                    f"{u['concurrency']:>2} {u['cache_percent']:>5g}% {u['policy']:>6} {u['hit_rate']:>11.3f} {s['hit_rate']:>10.3f} "
                    f"{gain['hit_rate_gain']:>+6.3f} {gain['tokens_per_s_ratio']:>20.2f}x"
                )
            summary["skew_gain"] = gains
    write_results(args.out, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
