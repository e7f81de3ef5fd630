"""Starts the whole stack (the launcher and its four processes) once for the e2e tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.stack_client import free_port_block
from shared.config import DEFAULT_MODEL_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post(url: str, body: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metric_value(text: str, name: str) -> float:
    """The first sample of ``name`` (``metric`` or ``metric{label="value",...}``, a subset of its labels) in ``text``."""
    base, _, selector = name.partition("{")
    wanted = dict(part.split("=", 1) for part in selector.rstrip("}").split(",") if part)
    wanted = {key: value.strip('"') for key, value in wanted.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == base and wanted.items() <= sample.labels.items():
                return sample.value
    raise KeyError(name)


def wait_until_quiescent(stack: Stack, timeout: float) -> str:
    """Waits until the scheduler holds no KV block and runs no request; returns its last /metrics text."""
    deadline = time.monotonic() + timeout
    while True:
        text = stack.metrics("scheduler")
        if metric_value(text, "tokenyard:kv_blocks_used") == 0 and metric_value(text, "tokenyard:num_requests_running") == 0:
            return text
        if time.monotonic() > deadline:
            pytest.fail(f"the scheduler still holds KV blocks or requests after {timeout:g}s")
        time.sleep(0.1)


@dataclass
class Stack:
    port: int
    process: subprocess.Popen
    log_path: str
    seen_while_loading: list[tuple[str, int, bytes]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self, process: str) -> str:
        offset = {"api": 0, "scheduler": 1, "worker": 2, "detokenizer": 3}[process]
        return http_get(f"http://127.0.0.1:{self.port + offset}/metrics")[1].decode()

    def instrumentation(self, process: str) -> dict:
        import json

        offset = {"api": 0, "scheduler": 1, "worker": 2, "detokenizer": 3}[process]
        return json.loads(http_get(f"http://127.0.0.1:{self.port + offset}/instrumentation")[1])

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    if not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, ".complete")):
        pytest.fail(f"the default model is missing at {DEFAULT_MODEL_DIR}: run `make setup`")
    port = free_port_block()
    log_path = str(tmp_path_factory.mktemp("stack") / "stack.log")
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "services.launcher", "--port", str(port), "--kv-cache-tokens", "8192"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    stack = Stack(port=port, process=process, log_path=log_path)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"the launcher exited with {process.returncode}:\n{stack.log()[-4000:]}")
            try:
                status, body = http_get(f"{stack.base_url}/health", timeout=2)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
                continue
            if status == 200:
                break
            # While loading, the api answers, and refuses generation with a 503.
            post = http_post(f"{stack.base_url}/v1/completions", b'{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 1}')
            stack.seen_while_loading.append((body.decode(), *post))
            time.sleep(0.2)
        else:
            pytest.fail(f"the stack did not become ready:\n{stack.log()[-4000:]}")
        children = [stack.instrumentation(name)["pid"] for name in ("api", "scheduler", "worker", "detokenizer")]
        yield stack
        # Ctrl-C on the launcher stops every process it started.
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
        assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")], "a child outlived the launcher"
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
