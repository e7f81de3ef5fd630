"""Time to ready and time to recover: the launcher started cold until ``/health`` answers 200, and a
SIGKILLed worker until the stack answers a chat request again; medians over rounds.

    python -m bench.ready_time [--model DIR] [--rounds 3] [--port 18700] [-- extra launcher flags]

Prints one line per round and a JSON summary (``--out`` writes it too). The C++ kernels must be built
already (``make setup``): their first build is not a start-up cost.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from services.worker.cpu_cache import l3_cache_bytes
from services.worker.device import cpu_name
from shared.config import DEFAULT_MODEL_DIR

POLL_S = 0.05


def http(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except (OSError, ValueError):
        return 0, {}


def wait_for(check, timeout: float) -> float:
    """Seconds until ``check()`` is true (polled every POLL_S); raises after ``timeout``."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"not within {timeout:g}s")
        time.sleep(POLL_S)
    return time.monotonic() - started


def answers_chat(base: str, model_id: str) -> bool:
    status, _ = http(f"{base}/v1/chat/completions", {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    return status == 200


def one_round(args: argparse.Namespace, log_path: str) -> dict:
    base = f"http://127.0.0.1:{args.port}"
    with open(log_path, "a") as log:
        started = time.monotonic()
        launcher = subprocess.Popen(
            [sys.executable, "-m", "services.launcher", "--model", args.model, "--port", str(args.port), *args.flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for(lambda: http(f"{base}/health", timeout=2)[0] == 200, args.timeout)
            ready = time.monotonic() - started
            model_id = http(f"{base}/v1/models")[1]["data"][0]["id"]
            worker_pid = http(f"http://127.0.0.1:{args.port + 2}/instrumentation")[1]["pid"]
            killed = time.monotonic()
            os.kill(worker_pid, signal.SIGKILL)
            wait_for(lambda: http(f"{base}/health", timeout=2)[0] != 200, args.timeout)
            wait_for(lambda: answers_chat(base, model_id), args.timeout)
            recovered = time.monotonic() - killed
        finally:
            os.killpg(launcher.pid, signal.SIGTERM)
            try:
                launcher.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    return {"ready_s": round(ready, 2), "recover_s": round(recovered, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR, help="model directory (default: the embedded default model)")
    parser.add_argument("--rounds", type=int, default=3, help="cold starts, each followed by one killed worker")
    parser.add_argument("--port", type=int, default=18700, help="the api's port; metrics ports follow it")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for any one event")
    parser.add_argument("--out", help="write the JSON summary here too")
    parser.add_argument("flags", nargs="*", help="extra launcher flags (after --)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    log_path = os.path.join(tempfile.gettempdir(), f"ready-time-{args.port}.log")
    rounds = []
    for i in range(args.rounds):
        result = one_round(args, log_path)
        print(f"round {i + 1}: ready {result['ready_s']} s, recovered {result['recover_s']} s", flush=True)
        rounds.append(result)
    summary = {
        "model": args.model,
        "flags": args.flags,
        "cpu": cpu_name(),
        "isa": [flag for flag in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if flag in _cpu_flags()],
        "l3_bytes": l3_cache_bytes(),
        "cores": len(os.sched_getaffinity(0)),
        "rounds": rounds,
        "median": {key: round(statistics.median(r[key] for r in rounds), 2) for key in rounds[0]},
        "log": log_path,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


if __name__ == "__main__":
    main()
