"""What one streamed chunk costs the api process itself, and so how many chunks per second one api serves.

The api runs alone, as the stack starts it, on a CPU of its own; a scripted engine in this process takes
its place on the api's real ZeroMQ sockets (it receives the api's Submit and Abort frames, reports itself
ready and sends one TextBatch per step, with one one-token TextDelta for each open request, as the
detokenizer does), and the lean client of shared/devtools/sse.py reads the chat streams. The engine and the
client share the other CPU. Each round runs ``--streams`` streams of ``--tokens`` chunks each and reads the
api's CPU time over it (every thread, ZeroMQ's included):

    python -m bench.api_capacity [--streams 1,8,32] [--tokens 256] [--step-ms 2] [--rounds 5]

``--neighbour`` puts a process on the api's CPU beside it, under SCHED_IDLE (so that the api preempts it at
once, as it does the CPU worker's pool helper in the stack): ``registers`` keeps the core busy in a loop that
touches no memory, ``memory`` streams 64 MB over and over, as the worker's weights stream through that core's
caches. Together with ``--step-ms`` (how long the api sleeps between chunks) and the stream counts (one wake-up
for one chunk, or for many) it tells the cost of a chunk's path from a wake-up's and from cold caches'.

The api's CPU per chunk is the figure to watch: with a fast engine (a GPU worker's steps of a few ms over
many streams) one api process saturates at about 1 / (CPU per chunk) chunks per second, and in the CPU stack
that CPU comes out of the worker's (bench.stack_throughput). A chunk that wakes the api alone costs it several
times a chunk among many (bench/README.md, "The api's own cost per chunk").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from statistics import median

import zmq

from bench.report import write_results
from bench.stack_throughput import process_cpu_seconds, user_system_seconds
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.devtools.sse import stream_chat
from shared.devtools.stack import free_port_block, served_model, stop_process, wait_healthy
from shared.frames import Abort, EngineStatus, FinishReason, Submit, TextBatch, TextDelta
from shared.transport import Inbox, Outbox

PROMPT = [{"role": "user", "content": "Tell me a story."}]

# What --neighbour runs on the api's CPU: a loop in registers, or a scan of 64 MB of written (so real) pages.
NEIGHBOURS = {
    "none": None,
    "registers": "x = 0\nwhile True:\n    x += 1\n",
    "memory": "buf = b'\\x02' * (64 << 20)\nwhile True:\n    buf.find(b'\\x01')\n",
}


def start_neighbour(kind: str, cpus: set[int]) -> subprocess.Popen | None:
    code = NEIGHBOURS[kind]
    if code is None:
        return None

    def placed() -> None:
        os.sched_setaffinity(0, cpus)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

    return subprocess.Popen([sys.executable, "-c", code], preexec_fn=placed)


class ScriptedEngine(threading.Thread):
    """Stands in for a scheduler and its detokenizer: every ``step_s`` one TextBatch with a token for each
    open request, the last one finishing it ("length"); a status frame every heartbeat."""

    def __init__(self, config: StackConfig, step_s: float) -> None:
        super().__init__(daemon=True)
        self.config = config
        self.step_s = step_s
        self.stopping = threading.Event()
        self.open: dict[str, list[int]] = {}  # rid -> [tokens sent, max_tokens, prompt tokens]

    def run(self) -> None:
        ctx = zmq.Context()
        inbox = Inbox(ctx, self.config.scheduler_address, "bench_engine_inbox")
        to_api = Outbox(ctx, self.config.api_address, "bench_engine_to_api")
        next_status = next_step = 0.0
        try:
            while not self.stopping.is_set():
                # A step every step_s, however soon a frame arrives: ZeroMQ's poll takes whole milliseconds
                # (a shorter step polls without waiting, then sleeps the rest).
                for frame in inbox.recv(max(0, int((next_step - time.monotonic()) * 1000))):
                    if isinstance(frame, Submit):
                        self.open[frame.rid] = [0, frame.max_tokens, len(frame.prompt_ids)]
                    elif isinstance(frame, Abort):
                        self.open.pop(frame.rid, None)
                if (rest := next_step - time.monotonic()) > 0:
                    time.sleep(rest)
                next_step = max(next_step + self.step_s, time.monotonic())  # late steps are not made up in a burst
                if time.monotonic() >= next_status:
                    to_api.send(EngineStatus(state="ready", boot="bench", detail="scripted engine", running=len(self.open)))
                    next_status = time.monotonic() + self.config.heartbeat_s
                if self.open:
                    to_api.send(TextBatch(deltas=[self._step(rid) for rid in list(self.open)]))
        finally:
            inbox.close()
            to_api.close()
            ctx.term()

    def _step(self, rid: str) -> TextDelta:
        request = self.open[rid]
        request[0] += 1
        sent, max_tokens, prompt_tokens = request
        finish = FinishReason.LENGTH if sent >= max_tokens else None
        if finish is not None:
            del self.open[rid]
        return TextDelta(rid=rid, text=" word", completion_tokens=sent, finish=finish, prompt_tokens=prompt_tokens)


async def _round(url: str, model: str, streams: int, tokens: int, api_pid: int) -> dict:
    cpu_before, split_before, started = process_cpu_seconds(api_pid), user_system_seconds(api_pid), time.perf_counter()
    runs = await asyncio.gather(*(stream_chat(url, model, PROMPT, tokens) for _ in range(streams)))
    wall, cpu = time.perf_counter() - started, process_cpu_seconds(api_pid) - cpu_before
    split = [after - before for after, before in zip(user_system_seconds(api_pid), split_before)]
    chunks = sum(len(r.chunk_times) for r in runs)
    if chunks != streams * tokens:
        raise RuntimeError(f"expected {streams * tokens} content chunks, got {chunks}")
    return {"chunks": chunks, "wall_s": wall, "api_cpu_s": cpu, "api_cpu_us_per_chunk": 1e6 * cpu / chunks, "api_user_system_s": split}


def _stream_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated stream counts, got {text!r}") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"stream counts must be positive, got {text!r}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR, help="the model directory whose tokenizer and chat template the api loads")
    parser.add_argument("--streams", type=_stream_counts, default=[1, 8, 32], help="comma-separated stream counts (default 1,8,32)")
    parser.add_argument("--tokens", type=int, default=256, help="chunks per stream")
    parser.add_argument("--step-ms", type=float, default=2.0, help="the scripted engine's step interval")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--neighbour", choices=sorted(NEIGHBOURS), default="none", help="a process beside the api on its CPU (see above)")
    parser.add_argument("--out", default="bench/results/api_capacity.json")
    args = parser.parse_args()
    levels = args.streams
    if args.rounds < 1 or args.tokens < 1 or args.step_ms <= 0:
        parser.error("--rounds, --tokens and --step-ms must be positive")
    cpus = sorted(os.sched_getaffinity(0))
    api_cpus, own_cpus = ({cpus[-1]}, set(cpus[:-1])) if len(cpus) > 1 else (set(cpus), set(cpus))

    port = free_port_block()
    with tempfile.TemporaryDirectory(prefix="tokenyard-bench-") as run_dir:
        flags = ["--port", str(port), "--run-dir", run_dir]
        config = StackConfig.from_argv(flags, "bench")
        os.sched_setaffinity(0, own_cpus)  # the engine thread and the client; the api gets the rest
        engine = ScriptedEngine(config, args.step_ms / 1000)
        engine.start()
        api = subprocess.Popen(
            [sys.executable, "-m", "services.api", "--model", args.model, *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: os.sched_setaffinity(0, api_cpus),
        )
        url = f"http://127.0.0.1:{port}"
        results: dict = {
            "streams": levels,
            "tokens": args.tokens,
            "step_ms": args.step_ms,
            "neighbour": args.neighbour,
            "api_cpus": sorted(api_cpus),
            "rounds": [],
        }
        neighbour = None
        try:
            wait_healthy(url, api, 120, "the api")
            neighbour = start_neighbour(args.neighbour, api_cpus)
            model = served_model(url)
            asyncio.run(_round(url, model, 1, 8, api.pid))  # warm-up, not counted
            for index in range(args.rounds):
                results["rounds"].append({str(n): asyncio.run(_round(url, model, n, args.tokens, api.pid)) for n in levels})
                print(
                    f"round {index + 1}: " + ", ".join(f"{n} streams {results['rounds'][-1][str(n)]['api_cpu_us_per_chunk']:.1f} us" for n in levels),
                    flush=True,
                )
        finally:
            if neighbour is not None:
                results["neighbour_cpu_s"] = process_cpu_seconds(neighbour.pid)  # what it got of the api's CPU meanwhile
                neighbour.kill()
                neighbour.wait()
            stop_process(api, grace_s=30)
            engine.stopping.set()
            engine.join(10)

    results["median_api_cpu_us_per_chunk"] = {str(n): median(r[str(n)]["api_cpu_us_per_chunk"] for r in results["rounds"]) for n in levels}
    for n in levels:
        us = results["median_api_cpu_us_per_chunk"][str(n)]
        rounds = [r[str(n)] for r in results["rounds"]]
        chunks = sum(r["chunks"] for r in rounds)
        user, kernel = (1e6 * sum(r["api_user_system_s"][mode] for r in rounds) / chunks for mode in (0, 1))
        results.setdefault("api_user_kernel_us_per_chunk", {})[str(n)] = [user, kernel]
        print(
            f"{n:>3} streams: the api's CPU per chunk {us:.1f} us (median of {args.rounds} rounds; user / kernel {user:.0f} / {kernel:.0f} us over "
            f"all rounds): at most ~{1e6 / us:,.0f} chunks/s per api core"
        )
    write_results(args.out, results)


if __name__ == "__main__":
    main()
