"""docker-compose.yml runs the same stack as the launcher: one process per container, one set of flags.

Also checks the wiring a container relies on: each inbox is bound by a service name that resolves
to its own container, the listeners are reachable from other containers, Prometheus scrapes every
metrics port and Grafana finds Prometheus and the dashboards.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import socket
from urllib.parse import urlparse

import pytest
import zmq

from shared.config import StackConfig
from shared.frames import Abort
from shared.transport import Curve, Inbox, Outbox, check_binds, create_keys
from tests.deploy.files import (
    KEYS_COMMAND,
    PROCESSES,
    PROMETHEUS_FILE,
    ROOT,
    flag_names,
    flags_of,
    host_names,
    load_compose,
    load_yaml,
    process_of,
    prometheus_targets,
    service_argv,
    stack_config,
    tokenyard_services,
)

FIELDS = {f.name for f in dataclasses.fields(StackConfig)}
# A service of the `replicas` profile differs from the default stack only in naming its replica:
# the engine-1 processes in their inboxes, the api in the engines it routes to.
REPLICA_FIELDS = {"scheduler_addr", "worker_addr", "detokenizer_addr", "engines", "router_policy"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return tokenyard_services(compose)


def default_services(services: dict) -> dict:
    """The services `docker compose up` starts (no profile)."""
    return {name: service for name, service in services.items() if not service.get("profiles")}


def test_every_tokenyard_service_runs_its_process(services) -> None:
    assert services, "no service runs a tokenyard image"
    for name, service in services.items():
        process = process_of(service)
        assert process in PROCESSES, f"{name} runs {service.get('entrypoint')} {service.get('command')}, not python -m services.<process>"
        replica = re.fullmatch(rf"{process}-\d+", name) is not None  # an engine replica's own process
        assert replica or process in host_names(name, service), f"{name} runs services.{process} but does not answer to the name {process!r}"
    by_default = sorted(process_of(service) for service in default_services(services).values())
    assert by_default == sorted(PROCESSES), "`docker compose up` must start each process exactly once"


def test_every_flag_is_a_stack_config_field(services) -> None:
    for name, service in services.items():
        names = flag_names(flags_of(service))
        unknown = sorted(set(names) - FIELDS)
        assert not unknown, f"{name} passes flags that StackConfig does not define: {unknown}"
        assert len(names) == len(set(names)), f"{name} passes a flag twice: {names}"
        try:
            StackConfig.from_argv(flags_of(service))
        except SystemExit:
            pytest.fail(f"{name}'s flags do not parse: {flags_of(service)}")


def test_all_services_run_the_same_stack_config(services) -> None:
    # The launcher passes one argv to every child; compose must too (model, addresses, ports).
    configs = {name: stack_config(service) for name, service in services.items()}
    reference = configs["api"]
    assert reference.detokenize_in == "detokenizer", "compose runs a detokenizer service: every process must be told so"
    for name, config in configs.items():
        allowed = REPLICA_FIELDS if "replicas" in services[name].get("profiles", []) else set()
        differing = {f: (getattr(config, f), getattr(reference, f)) for f in FIELDS - allowed if getattr(config, f) != getattr(reference, f)}
        assert not differing, f"{name} disagrees with api on {differing}"


def test_the_replicas_profile_routes_between_two_engines(services) -> None:
    replicas = {name: service for name, service in services.items() if "replicas" in service.get("profiles", [])}
    (api,) = [stack_config(s) for s in replicas.values() if process_of(s) == "api"]
    schedulers = {
        stack_config(s).scheduler_address for s in services.values() if process_of(s) == "scheduler" and not set(s.get("profiles", [])) - {"replicas"}
    }
    assert len(api.engine_addresses) == 2 and set(api.engine_addresses.values()) == schedulers
    for process in ("scheduler", "worker", "detokenizer"):  # engine-1 sends its replies to the same api
        (engine_1,) = [stack_config(s) for s in replicas.values() if process_of(s) == process]
        assert engine_1.api_address == api.api_address


def test_the_model_is_mounted_where_every_service_looks(services) -> None:
    for name, service in services.items():
        model = stack_config(service).model
        mounts = [volume.split(":")[1] for volume in service["volumes"]]
        assert any(model == mount or model.startswith(mount.rstrip("/") + "/") for mount in mounts), f"{name}: --model {model} is outside its volumes {mounts}"


def test_each_inbox_is_bound_by_the_name_of_its_own_service(services) -> None:
    # A process binds its own inbox address and the others connect to it, so the host must be a
    # name that resolves to the binding container (not `*`, which cannot be connected to).
    for name, service in services.items():
        process = process_of(service)
        address = urlparse(getattr(stack_config(service), f"{process}_address"))
        assert address.scheme == "tcp", f"{name}'s inbox {address.geturl()} is not tcp"
        assert address.hostname in host_names(name, service), f"{name}'s inbox host {address.hostname!r} is not a name of service {name}"
    config = stack_config(services["api"])
    addresses = {process: urlparse(getattr(config, f"{process}_address")) for process in PROCESSES}
    assert len({address.port for address in addresses.values()}) == len(PROCESSES), "inbox ports collide"


def test_listeners_are_reachable_from_other_containers(services) -> None:
    config = stack_config(services["api"])
    assert config.host == "0.0.0.0" and config.metrics_host == "0.0.0.0"
    published = [str(port).split(":")[-1] for port in services["api"].get("ports", [])]
    assert str(config.port) in published, "the api port is not published"


def test_prometheus_scrapes_every_metrics_port(compose, services) -> None:
    config = stack_config(services["api"])
    wanted = {f"{process}:{config.metrics_port(process)}" for process in PROCESSES}
    wanted |= {f"{name}:{config.metrics_port(process_of(s))}" for name, s in services.items() if re.fullmatch(r"[a-z]+-\d+", name)}
    targets = prometheus_targets(load_yaml(PROMETHEUS_FILE))
    assert wanted <= targets, f"Prometheus does not scrape {sorted(wanted - targets)}"
    prometheus = compose["services"]["prometheus"]
    config_flag = next(arg for arg in prometheus["command"] if arg.startswith("--config.file="))
    mounted = {volume.split(":")[1]: volume.split(":")[0] for volume in prometheus["volumes"]}
    assert os.path.normpath(mounted[config_flag.split("=", 1)[1]]) == os.path.relpath(PROMETHEUS_FILE, ROOT)


def test_grafana_finds_prometheus_and_the_dashboards(compose) -> None:
    grafana = compose["services"]["grafana"]
    mounts = {os.path.normpath(volume.split(":")[0]): volume.split(":")[1] for volume in grafana["volumes"]}
    provisioning = os.path.join(ROOT, "deploy", "grafana", "provisioning")
    assert mounts[os.path.join("deploy", "grafana", "provisioning")] == "/etc/grafana/provisioning"
    (datasource,) = load_yaml(os.path.join(provisioning, "datasources", "prometheus.yml"))["datasources"]
    url = urlparse(datasource["url"])
    assert url.hostname in compose["services"] and url.port == 9090
    (provider,) = load_yaml(os.path.join(provisioning, "dashboards", "tokenyard.yml"))["providers"]
    assert mounts[os.path.join("deploy", "grafana", "dashboards")] == provider["options"]["path"]


def _healthcheck_module():
    spec = importlib.util.spec_from_file_location("deploy_healthcheck", os.path.join(ROOT, "deploy", "healthcheck.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_image_healthcheck_asks_each_process_on_its_port(services) -> None:
    healthcheck = _healthcheck_module()
    for name, service in services.items():
        process = process_of(service)
        url = healthcheck.health_url([f"services.{process}", *flags_of(service)])
        assert url == f"http://127.0.0.1:{stack_config(service).metrics_port(process)}/health", name
        assert service["healthcheck"]["test"][1:] == ["python", "/opt/tokenyard/healthcheck.py"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_inbox_binds_a_host_name_that_its_peers_connect_to() -> None:
    # Compose passes `tcp://scheduler:5551` both to the scheduler (bind) and to its peers
    # (connect); libzmq resolves a bind host through getaddrinfo, as it does a connect host.
    ctx = zmq.Context()
    address = f"tcp://localhost:{_free_port()}"
    inbox = Inbox(ctx, address, "deploy_inbox")
    outbox = Outbox(ctx, address, "deploy_outbox")
    outbox.send(Abort(rid="r1"))
    received = []
    for _ in range(20):
        received += list(inbox.recv(100))
        if received:
            break
    assert received == [Abort(rid="r1")]
    outbox.close()
    inbox.close()
    ctx.term()


def test_inboxes_outside_loopback_speak_curve_with_keys_from_the_one_shot_service(compose, services) -> None:
    keys = compose["services"]["keys"]
    assert service_argv(keys)[:4] == KEYS_COMMAND
    directory = service_argv(keys)[4]
    volume = next(v.split(":")[0] for v in keys["volumes"] if v.split(":")[1] == directory)
    assert volume in compose["volumes"]
    for name, service in services.items():
        config = stack_config(service)
        addresses = [config.api_address, config.scheduler_address, config.worker_address, config.detokenizer_address]
        check_binds(addresses, config.curve_key_file)  # what the processes check before they bind
        assert os.path.dirname(config.curve_key_file) == directory and os.path.basename(config.curve_key_file) == "stack.key_secret", name
        assert f"{volume}:{directory}:ro" in service["volumes"], f"{name} does not mount the keys volume read-only"
        assert service["depends_on"]["keys"]["condition"] == "service_completed_successfully", name
    assert "TOKENYARD_API_KEY" in compose["services"]["api"]["environment"]


def test_the_keys_service_writes_a_certificate_once(tmp_path) -> None:
    first = create_keys(str(tmp_path))
    with open(first) as f:
        written = f.read()
    assert create_keys(str(tmp_path)) == first
    with open(first) as f:
        assert f.read() == written  # kept: a restart of the stack does not lock out running peers
    assert Curve.load(first).secret


def test_the_tracing_profile_runs_a_collector_that_every_process_and_grafana_can_reach(compose, services) -> None:
    # Off unless OTLP_TRACES_ENDPOINT is set: every process takes it from the one variable.
    raw = tokenyard_services(load_yaml(os.path.join(ROOT, "docker-compose.yml")))
    assert all("--otlp-traces-endpoint=${OTLP_TRACES_ENDPOINT:-}" in flags_of(service) for service in raw.values())
    assert all(stack_config(service).otlp_traces_endpoint == "" for service in services.values())
    jaeger = compose["services"]["jaeger"]
    assert jaeger["profiles"] == ["tracing"] and {"4317", "4318"} <= set(jaeger["expose"])
    (datasource,) = load_yaml(os.path.join(ROOT, "deploy", "grafana", "provisioning", "datasources", "jaeger.yml"))["datasources"]
    assert datasource["type"] == "jaeger" and urlparse(datasource["url"]).hostname == "jaeger"
