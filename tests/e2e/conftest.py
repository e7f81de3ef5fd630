"""Starts the whole stack (the launcher and its processes, in the default ``--detokenize-in api``) once for
the e2e tests, and what the e2e tests share: starting and stopping stacks and services, health and metrics probes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.config import DEFAULT_MODEL_DIR
from shared.devtools.random_model import build_random_smollm
from shared.devtools.stack import free_port_block, stop_process

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


def metric_value(text: str, name: str, default: float | None = None) -> float:
    """The first sample of ``name`` (``metric`` or ``metric{label="value",...}``, a subset of its labels) in ``text``;
    ``default`` if there is none (a labelled counter's series appears at its first increment), else KeyError."""
    base, _, selector = name.partition("{")
    wanted = dict(part.split("=", 1) for part in selector.rstrip("}").split(",") if part)
    wanted = {key: value.strip('"') for key, value in wanted.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == base and wanted.items() <= sample.labels.items():
                return sample.value
    if default is not None:
        return default
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
    detokenize_in: str = "api"  # the launcher's default
    seen_while_loading: list[tuple[str, int, bytes]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def processes(self) -> tuple[str, ...]:
        """The processes the launcher runs: a detokenizer only with ``--detokenize-in detokenizer``."""
        return ("api", "scheduler", "worker") + (("detokenizer",) if self.detokenize_in == "detokenizer" else ())

    @property
    def text_maker(self) -> str:
        """The process that turns tokens into text (and exports ``tokenyard:detokenizer_requests``)."""
        return self.detokenize_in

    def metrics(self, process: str) -> str:
        offset = {"api": 0, "scheduler": 1, "worker": 2, "detokenizer": 3}[process]
        return http_get(f"http://127.0.0.1:{self.port + offset}/metrics")[1].decode()

    def instrumentation(self, process: str) -> dict:
        offset = {"api": 0, "scheduler": 1, "worker": 2, "detokenizer": 3}[process]
        return json.loads(http_get(f"http://127.0.0.1:{self.port + offset}/instrumentation")[1])

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


ENGINES = ("engine-0", "engine-1")


class Replicas:
    """A launcher's two engine replicas (``--replicas 2``) and the api at ``port`` routing among them;
    engine i's scheduler, worker and detokenizer serve /metrics at ``port + 1 + 3i`` onwards. Another
    api replica sharing the engines is asked by its port (``api_port``)."""

    def __init__(self, stack: Stack) -> None:
        self.port, self.process, self.log_path = stack.port, stack.process, stack.log_path
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0, timeout=60)

    def engine_port(self, engine: int, process: str) -> int:
        return self.port + 1 + 3 * engine + ("scheduler", "worker", "detokenizer").index(process)

    def metrics(self, engine: int) -> str:
        return http_get(f"http://127.0.0.1:{self.engine_port(engine, 'scheduler')}/metrics")[1].decode()

    def instrumentation(self, engine: int, process: str) -> dict | None:
        try:
            return json.loads(http_get(f"http://127.0.0.1:{self.engine_port(engine, process)}/instrumentation", timeout=2)[1])
        except (OSError, ValueError):
            return None

    def pid(self, engine: int, process: str) -> int | None:
        info = self.instrumentation(engine, process)
        return None if info is None else info["pid"]

    def routed(self, api_port: int | None = None) -> dict[str, float]:
        text = http_get(f"http://127.0.0.1:{api_port or self.port}/metrics")[1].decode()
        return {name: metric_value(text, f'tokenyard:router_requests_total{{replica="{name}"}}') for name in ENGINES}

    def in_rotation(self, api_port: int | None = None) -> dict[str, bool]:
        try:
            replicas = json.loads(http_get(f"http://127.0.0.1:{api_port or self.port}/instrumentation", timeout=2)[1])["replicas"]
        except (OSError, ValueError):  # the api is not up yet
            return {}
        return {r["name"]: r["in_rotation"] for r in replicas}

    def wait_all_in_rotation(self, timeout: float, api_port: int | None = None) -> None:
        deadline = time.monotonic() + timeout
        while sorted(name for name, ready in self.in_rotation(api_port).items() if ready) != list(ENGINES):
            assert self.process.poll() is None and time.monotonic() < deadline, self.log()[-3000:]
            time.sleep(0.2)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


@contextmanager
def running_service(service: str, port: int, flags: list[str], log_path: str) -> Iterator[Stack]:
    """``python -m services.<service> --port PORT FLAGS``, its output in ``log_path``; stopped on exit
    (Ctrl-C: the launcher stops every process it started, an api drains; SIGKILL after 30s)."""
    with open(log_path, "w") as log:
        argv = [sys.executable, "-m", f"services.{service}", "--port", str(port), *flags]
        process = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        detokenize_in = flags[flags.index("--detokenize-in") + 1] if "--detokenize-in" in flags else "api"
        yield Stack(port=port, process=process, log_path=log_path, detokenize_in=detokenize_in)
    finally:
        stop_process(process)


def launched_stack(port: int, flags: list[str], log_path: str) -> AbstractContextManager[Stack]:
    """The whole stack: the launcher on ``port`` with these flags."""
    return running_service("launcher", port, flags, log_path)


TINY_MODEL = "tiny-smollm"


@contextmanager
def tiny_model_stack(tmp_path_factory, name: str, flags: list[str]) -> Iterator[Stack]:
    """A healthy stack with these flags serving a random tiny SmolLM (``shared.devtools.random_model``) on one thread:
    for tests of the serving path, whose text need not mean anything."""
    tmp = tmp_path_factory.mktemp(name)
    build_random_smollm(str(tmp / TINY_MODEL))
    flags = ["--model", str(tmp / TINY_MODEL), "--num-threads", "1", "--kv-cache-tokens", "4096", *flags]
    with launched_stack(free_port_block(), flags, str(tmp / "stack.log")) as stack:
        wait_healthy(stack, 300)
        yield stack


def ask_tiny(oai: openai.OpenAI, **kwargs):
    """A chat completion of 40 tokens (ignore_eos, greedy unless ``kwargs`` say otherwise) from the tiny model."""
    settings = {"max_tokens": 40, "temperature": 0, **kwargs}
    return oai.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": "tell me"}], extra_body={"ignore_eos": True}, **settings)


def wait_supervised(stack: Stack, timeout: float) -> None:
    """Waits until the launcher says the stack is ready: from then on a child that dies is restarted.
    The api answers /health 200 a moment before the launcher's own poll sees it, and a child killed
    in between is a failed start, after which the launcher stops the whole stack; so a test that
    kills children waits for this line, not only for /health."""
    deadline = time.monotonic() + timeout
    while "tokenyard is ready" not in stack.log():
        assert stack.process.poll() is None and time.monotonic() < deadline, stack.log()[-3000:]
        time.sleep(0.2)


def wait_healthy(stack: Stack, timeout: float) -> float:
    """Waits until the api's /health answers 200; returns the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        assert stack.process.poll() is None, stack.log()[-3000:]
        try:
            if http_get(f"{stack.base_url}/health", timeout=2)[0] == 200:
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.25)
    pytest.fail(f"the stack did not become healthy:\n{stack.log()[-3000:]}")


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    if not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, ".complete")):
        pytest.fail(f"the default model is missing at {DEFAULT_MODEL_DIR}: run `make setup`")
    port = free_port_block()
    log_path = str(tmp_path_factory.mktemp("stack") / "stack.log")
    with launched_stack(port, ["--kv-cache-tokens", "8192"], log_path) as stack:
        process = stack.process
        deadline = time.monotonic() + 300
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
        children = [stack.instrumentation(name)["pid"] for name in stack.processes]
        yield stack
        assert stop_process(process) == 0  # Ctrl-C on the launcher stops every process it started
        assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")], "a child outlived the launcher"
