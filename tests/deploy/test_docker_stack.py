"""The compose stack in Docker: builds the image, starts docker-compose.yml's processes one per
container on their own network (addressed by service name, as compose does), answers a chat
completion, is scraped by Prometheus, and is torn down.

Driven by the docker SDK from the parsed compose file, so it needs an engine but not the compose
plugin. Skips when no Docker engine answers. Deselect with ``-m "not docker"``.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.deploy.files import PROCESSES, ROOT, load_compose, process_of, stack_config, tokenyard_services

docker = pytest.importorskip("docker", reason="the docker SDK is not installed (pip install -e '.[test]')")
from docker.utils.build import tar as build_context  # noqa: E402

pytestmark = pytest.mark.docker

READY_TIMEOUT_S = 600.0


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    try:
        client = docker.from_env(timeout=900)
        client.ping()
    except (docker.errors.DockerException, OSError) as exc:
        pytest.skip(f"no Docker engine answers ({exc})")
    yield client
    client.close()


def build_image(client: Any, service: dict[str, Any]) -> None:
    """Builds a service's image as compose would, with the build context its Dockerfile's ignore file allows."""
    dockerfile = service["build"]["dockerfile"]
    with open(os.path.join(ROOT, dockerfile + ".dockerignore")) as f:
        patterns = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    context = build_context(ROOT, exclude=patterns, dockerfile=(dockerfile, None))
    try:
        client.images.build(fileobj=context, custom_context=True, dockerfile=dockerfile, tag=service["image"], rm=True, forcerm=True)
    except docker.errors.BuildError as exc:
        log = "".join(chunk.get("stream", "") or chunk.get("error", "") for chunk in exc.build_log)
        pytest.fail(f"building {service['image']} failed: {exc.msg}\n{log[-4000:]}")


def nanoseconds(duration: str) -> int:
    """A compose duration ("10s", "1m30s") in nanoseconds."""
    units = {"ms": 1e6, "s": 1e9, "m": 60e9, "h": 3600e9}
    return int(sum(float(amount) * units[unit] for amount, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)))


def host_volume(volume: str) -> str:
    source, rest = volume.split(":", 1)
    return f"{os.path.normpath(os.path.join(ROOT, source))}:{rest}" if source.startswith(".") else volume


def host_model_dir(service: dict[str, Any]) -> str:
    """Where on this machine the directory behind the service's --model is."""
    model = stack_config(service).model
    for source, target in (host_volume(volume).split(":")[:2] for volume in service["volumes"]):
        if model.startswith(target.rstrip("/") + "/"):
            return os.path.join(source, model[len(target.rstrip("/")) + 1 :])
    raise AssertionError(f"--model {model} is not on a volume")


@dataclass
class Deployment:
    client: Any
    project: str = field(default_factory=lambda: f"tokenyard-test-{uuid.uuid4().hex[:8]}")
    containers: dict[str, Any] = field(default_factory=dict)
    network: Any = None

    def start(self, name: str, service: dict[str, Any], publish: tuple[int, ...] = ()) -> Any:
        """Runs one compose service: its image, entrypoint, command, volumes, healthcheck and names."""
        options: dict[str, Any] = {
            "name": f"{self.project}-{name}",
            "entrypoint": service.get("entrypoint"),
            "command": service.get("command"),
            "environment": service.get("environment"),
            "volumes": [host_volume(volume) for volume in service.get("volumes", []) if volume.startswith((".", "/"))],
            "init": service.get("init", False),
            "ports": {f"{port}/tcp": ("127.0.0.1", None) for port in publish},  # any free host port
            "network": self.network.name,
            "networking_config": {self.network.name: self.client.api.create_endpoint_config(aliases=[name])},
            "labels": {"com.docker.compose.project": self.project},
        }
        if "healthcheck" in service:
            check = service["healthcheck"]
            options["healthcheck"] = {
                "test": check["test"],
                **{key: nanoseconds(check[key]) for key in ("interval", "timeout", "start_period") if key in check},
                "retries": check.get("retries", 3),
            }
        container = self.client.containers.create(service["image"], **options)
        container.start()
        self.containers[name] = container
        return container

    def host_port(self, name: str, port: int) -> int:
        container = self.containers[name]
        container.reload()
        return int(container.ports[f"{port}/tcp"][0]["HostPort"])

    def wait_healthy(self, names: list[str]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            states = {}
            for name in names:
                container = self.containers[name]
                container.reload()
                states[name] = (container.status, container.attrs["State"].get("Health", {}).get("Status"))
            if all(health == "healthy" for _, health in states.values()):
                return
            broken = [name for name, (status, health) in states.items() if status in ("exited", "dead") or health == "unhealthy"]
            if broken or time.monotonic() > deadline:
                pytest.fail(f"containers did not become healthy: {states}\n{self.logs(broken or names)}")
            time.sleep(2)

    def logs(self, names: list[str]) -> str:
        return "\n".join(f"--- {name}\n{self.containers[name].logs(tail=40).decode(errors='replace')}" for name in names)

    def tear_down(self) -> None:
        for container in self.containers.values():
            try:
                container.remove(force=True)
            except docker.errors.APIError:
                pass
        if self.network is not None:
            self.network.remove()


@pytest.fixture(scope="module")
def deployment(client) -> Iterator[Deployment]:
    compose = load_compose()
    services = {name: service for name, service in tokenyard_services(compose).items() if not service.get("profiles")}
    model = host_model_dir(services["api"])
    if not os.path.isfile(os.path.join(model, "config.json")):
        pytest.fail(f"no model at {model} to mount: run `make setup`")
    for image in {service["image"]: service for service in services.values()}.values():
        build_image(client, image)
    deployment = Deployment(client)
    deployment.network = client.networks.create(deployment.project, driver="bridge", labels={"com.docker.compose.project": deployment.project})
    try:
        for name, service in services.items():
            deployment.start(name, service, publish=(stack_config(service).port,) if process_of(service) == "api" else ())
        deployment.wait_healthy(list(services))
        yield deployment
    finally:
        deployment.tear_down()


def post_json(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_the_compose_stack_answers_a_chat_completion(deployment: Deployment) -> None:
    api = load_compose()["services"]["api"]
    port = deployment.host_port("api", stack_config(api).port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as response:
        model = json.load(response)["data"][0]["id"]
    status, answer = post_json(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8, "temperature": 0},
    )
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"], answer
    assert answer["usage"]["completion_tokens"] > 0


def test_prometheus_in_compose_scrapes_every_process(deployment: Deployment) -> None:
    prometheus = load_compose()["services"]["prometheus"]
    try:
        deployment.client.images.pull(prometheus["image"])
    except docker.errors.APIError as exc:
        pytest.skip(f"cannot pull {prometheus['image']}: {exc}")
    deployment.start("prometheus", prometheus, publish=(9090,))  # its named data volume is left out
    url = f"http://127.0.0.1:{deployment.host_port('prometheus', 9090)}/api/v1/query?" + urllib.parse.urlencode({"query": 'up{job="tokenyard"}'})
    deadline = time.monotonic() + 60
    up: dict[str, str] = {}
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                up = {series["metric"]["service"]: series["value"][1] for series in json.load(response)["data"]["result"]}
        except (urllib.error.URLError, OSError):
            pass
        if up == dict.fromkeys(PROCESSES, "1"):
            return
        time.sleep(1)
    pytest.fail(f"Prometheus sees {up}\n{deployment.logs(['prometheus'])}")


def test_the_cuda_image_sees_a_gpu(client) -> None:
    if "nvidia" not in (client.info().get("Runtimes") or {}):
        pytest.skip("the Docker engine has no NVIDIA runtime")
    worker = load_compose()["services"]["worker-gpu"]
    build_image(client, worker)
    output = client.containers.run(
        worker["image"],
        ["python", "-c", "import torch; print(torch.cuda.is_available())"],
        device_requests=[docker.types.DeviceRequest(count=1, capabilities=[["gpu"]])],
        remove=True,
    )
    assert output.decode().strip().endswith("True")
