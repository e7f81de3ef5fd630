"""Prometheus accepts the deploy config, and every query of the Grafana dashboard returns data.

The real-Prometheus test starts a Prometheus whose config is the deploy one with its targets on
free local ports (scraping every second), then the stack on those ports with the launcher, wired
as compose wires it (docker-compose.yml's flags, each inbox on tcp and bound by host name). It
sends chat completions in two rounds (so every rate() sees a counter move between two scrapes),
then evaluates each dashboard query through Prometheus's HTTP API, Grafana variables substituted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.devtools.stack import free_port_block
from shared.transport import create_keys
from tests.deploy.files import (
    PROCESSES,
    PROMETHEUS_FILE,
    ROOT,
    dashboard_queries,
    load_compose,
    load_dashboard,
    load_yaml,
    stack_config,
    tokenyard_services,
)

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
INSTALL_HINT = "install it with `apt-get install prometheus` (Debian), as .ci/run does"

# Grafana's built-in variables, as a dashboard over the last few minutes would set them: the
# rate window must span the whole (short) traffic of the test.
GRAFANA_MACROS = {"__rate_interval": "1m", "__interval": "1s", "__range": "5m"}
PROMPT = "You are a careful assistant. " * 12  # long enough to fill KV blocks the prefix cache can share


def test_promtool_accepts_the_deploy_config() -> None:
    if PROMTOOL is None:
        pytest.skip(f"promtool is not installed: {INSTALL_HINT}")
    result = subprocess.run([PROMTOOL, "check", "config", PROMETHEUS_FILE], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- the real-Prometheus test -------------------------------------------------------------------


def http(url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def local_stack_flags(port: int, first_inbox: int, curve_key_file: str) -> list[str]:
    """docker-compose.yml's flags for this machine: the local model, loopback listeners on `port`
    (metrics ports following it), each inbox on tcp bound by a host name (localhost for the
    service name), and CURVE with keys made here (compose's come from its `keys` service)."""
    compose = stack_config(tokenyard_services(load_compose())["api"])
    inboxes = {}
    for offset, process in enumerate(PROCESSES):
        address = urllib.parse.urlparse(getattr(compose, f"{process}_addr"))
        assert (address.scheme, address.hostname) == ("tcp", process), f"compose's {process} inbox is {address.geturl()}"
        inboxes[f"{process}_addr"] = f"tcp://localhost:{first_inbox + offset}"
    local = dataclasses.replace(
        compose,
        model=DEFAULT_MODEL_DIR,
        host="127.0.0.1",
        metrics_host="127.0.0.1",
        port=port,
        scheduler_metrics_port=0,
        worker_metrics_port=0,
        detokenizer_metrics_port=0,
        kv_cache_tokens=4096,
        curve_key_file=curve_key_file,
        **inboxes,
    )
    return local.to_argv()


def local_prometheus_config(stack_port: int, prometheus_address: str) -> dict:
    """The deploy config, scraping every second, its compose targets mapped to the local stack's ports."""
    config = load_yaml(PROMETHEUS_FILE)
    config["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    local = StackConfig(port=stack_port)
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs", None)  # the replicas profile's second engine, not run here
        for static in job.get("static_configs", []):
            hosts = [target.split(":")[0] for target in static["targets"]]
            static["targets"] = [f"127.0.0.1:{local.metrics_port(host)}" if host in PROCESSES else prometheus_address for host in hosts]
    return config


@dataclass
class Observed:
    stack_url: str
    prometheus_url: str

    def query(self, expr: str) -> list[dict]:
        status, body = http(f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        answer = json.loads(body)
        assert status == 200 and answer["status"] == "success", f"{expr}: {answer}"
        return answer["data"]["result"]

    def wait_for(self, expr: str, done, timeout_s: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if done(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus never saw {expr} as expected: {result}")
            time.sleep(0.2)

    def wait_for_scrapes_after(self, moment: float) -> None:
        """Until Prometheus has scraped every tokenyard process after `moment` (a time.time())."""
        self.wait_for('min(timestamp(up{job="tokenyard"}))', lambda result: bool(result) and sample_values(result)[0] > moment)


def send_traffic(url: str, model: str, streams: tuple[bool, ...]) -> None:
    """Chat completions sharing a long system prompt, streamed or not."""
    for stream in streams:
        messages = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "Say hello."}]
        body = {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0, "stream": stream}
        status, answer = http(f"{url}/v1/chat/completions", body)
        assert status == 200, f"stream={stream}: {status} {answer[:500]!r}"


def sample_values(result: list[dict]) -> list[float]:
    return [float(series["value"][1]) for series in result]


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Grafana's `$name` and `${name}` (or `${name:format}`) replaced by their values."""
    pattern = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
    return pattern.sub(lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), expr)


def regex_alternation(values: list[str]) -> str:
    """A multi-value variable in a `=~` matcher, as Grafana formats it (inside a PromQL string)."""
    escaped = [re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", value) for value in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def resolve_variables(observed: Observed, dashboard: dict) -> dict[str, str]:
    """Values for the dashboard's query variables (`label_values(metric, label)`), read from Prometheus."""
    variables = dict(GRAFANA_MACROS)
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(r"label_values\((?P<metric>.+),\s*(?P<label>\w+)\)", query.strip())
        assert match, f"variable {variable['name']}: unsupported query {query}"
        values = sorted({series["metric"][match["label"]] for series in observed.query(f"count by ({match['label']}) ({match['metric']})")})
        assert values, f"variable {variable['name']} has no values: {query}"
        variables[variable["name"]] = regex_alternation(values)
    return variables


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> Iterator[Observed]:
    if PROMETHEUS is None:
        pytest.skip(f"prometheus is not installed: {INSTALL_HINT}")
    if not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, ".complete")):
        pytest.fail(f"the default model is missing at {DEFAULT_MODEL_DIR}: run `make setup`")
    tmp = tmp_path_factory.mktemp("prometheus")
    ports = free_port_block(9)  # api and metrics ports, four inboxes, Prometheus
    stack_flags = local_stack_flags(port=ports, first_inbox=ports + 4, curve_key_file=create_keys(str(tmp / "keys")))
    # Prometheus first: it discovers its targets while the stack loads and scrapes them once they answer.
    with running_prometheus(tmp, f"127.0.0.1:{ports + 8}", stack_port=ports) as prometheus_url, launched_stack(tmp, stack_flags) as stack_url:
        observed = Observed(stack_url, prometheus_url)
        observed.wait_for('up{job="tokenyard"} == 1', lambda result: len(result) == len(PROCESSES))
        model = json.loads(http(f"{stack_url}/v1/models")[1])["data"][0]["id"]
        # Two rounds with a scrape of every process between them (each process's scrapes have their
        # own offset), so every rate() sees its counters move; the counters created by round one
        # (labelled histograms appear at their first observation) need round two to move at all.
        for streams in ((False, True), (True,)):
            send_traffic(stack_url, model, streams)
            observed.wait_for_scrapes_after(time.time())
        yield observed


def wait_until_ready(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if http(url, timeout=2)[0] == 200:
                return
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{url} did not become ready:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)


def stop(process: subprocess.Popen, sig: int) -> None:
    process.send_signal(sig)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def launched_stack(tmp: Path, flags: list[str]) -> Iterator[str]:
    """The local launcher with these flags; yields the api URL once /health answers 200."""
    config = StackConfig.from_argv(flags)
    log_path = tmp / "stack.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "services.launcher", *flags], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{config.port}"
    try:
        wait_until_ready(f"{url}/health", process, log_path, timeout_s=300)
        yield url
    finally:
        stop(process, signal.SIGINT)  # Ctrl-C: the launcher stops every process it started


@contextmanager
def running_prometheus(tmp: Path, address: str, stack_port: int) -> Iterator[str]:
    """Prometheus on `address` with the local config; yields its URL once ready."""
    config_path = tmp / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(local_prometheus_config(stack_port, address)))
    log_path = tmp / "prometheus.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address={address}", "--log.level=warn"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until_ready(f"http://{address}/-/ready", process, log_path, timeout_s=30)
        yield f"http://{address}"
    finally:
        stop(process, signal.SIGTERM)


def test_every_process_reports_ready(observed: Observed) -> None:
    result = observed.query("max by (process) (tokenyard:process_up)")
    assert {series["metric"]["process"]: float(series["value"][1]) for series in result} == dict.fromkeys(PROCESSES, 1.0)


def test_the_image_healthcheck_passes_for_every_process(observed: Observed) -> None:
    port = int(observed.stack_url.rsplit(":", 1)[1])
    env = {**os.environ, "PYTHONPATH": ROOT}  # the image installs tokenyard; here it is the checkout
    for process in PROCESSES:
        pid = json.loads(http(f"http://127.0.0.1:{StackConfig(port=port).metrics_port(process)}/instrumentation")[1])["pid"]
        check = subprocess.run([sys.executable, "deploy/healthcheck.py", "--pid", str(pid)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, f"{process}: {check.stdout}{check.stderr}"


def test_every_dashboard_query_returns_data(observed: Observed) -> None:
    dashboard = load_dashboard()
    variables = resolve_variables(observed, dashboard)
    queries = dashboard_queries(dashboard)
    assert queries, "the dashboard has no queries"
    empty = []
    for title, expr in queries:
        promql = substitute(expr, variables)
        assert "$" not in promql, f"{title}: unsubstituted variable in {promql}"
        values = sample_values(observed.query(promql))
        if not any(math.isfinite(value) for value in values):
            empty.append(f"{title}: {promql} -> {values}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
