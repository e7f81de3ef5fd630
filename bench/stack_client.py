"""What the benchmarks share: starting a stack on a free port, streaming requests, percentiles."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp


def free_port_block(count: int = 4) -> int:
    """A port p such that p .. p+count-1 are free on loopback (the api and the metrics ports)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        socks = []
        try:
            for offset in range(count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free block of ports")


@contextmanager
def running_stack(model: str, *flags: str, timeout_s: float = 600, log_path: str | None = None) -> Iterator[str]:
    """Starts the launcher with these flags on free ports (its output to ``log_path``, or dropped); yields the
    base URL; stops it afterwards."""
    port = free_port_block()
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below, after the launcher
    process = subprocess.Popen([sys.executable, "-m", "services.launcher", "--model", model, "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout_s, "the stack")
        yield url
    finally:
        stop_process(process, grace_s=60)
        if log_path:
            log.close()


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float, what: str) -> None:
    """Returns once ``url``/health answers 200; raises if ``process`` exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become healthy within {timeout_s:g}s")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)


def stop_process(process: subprocess.Popen, grace_s: float = 30) -> int:
    """Ctrl-C (the launcher and llama-server both stop their children on it), then SIGKILL after
    ``grace_s``; returns the exit code (negative: killed by that signal)."""
    process.send_signal(signal.SIGINT)
    try:
        return process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models") as response:
        return json.load(response)["data"][0]["id"]


def chat_body(model: str, messages: list[dict], output_tokens: int) -> dict:
    """The benchmarks' chat request: greedy, ``output_tokens`` with ignore_eos, streamed with usage."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_chat(session: aiohttp.ClientSession, url: str, model: str, messages: list[dict], output_tokens: int) -> dict:
    """One greedy streamed chat request with ignore_eos; returns its start, token timestamps and usage."""
    body = chat_body(model, messages, output_tokens)
    started = time.perf_counter()
    stamps: list[float] = []
    usage: dict = {}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    return {"start": started, "stamps": stamps, "end": time.perf_counter(), "usage": usage}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def write_results(path: str, results: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")
