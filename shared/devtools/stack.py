"""Starting a server on free loopback ports, waiting until it is healthy and stopping it: the launcher's stack
for the benchmarks and the tests, llama-server for ``bench.serve``."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager


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
