"""Reads the deployment files (compose, Prometheus, Grafana) the way Compose and the stack read them."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import yaml

from shared.config import StackConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPOSE_FILE = os.path.join(ROOT, "docker-compose.yml")
PROMETHEUS_FILE = os.path.join(ROOT, "deploy", "prometheus", "prometheus.yml")
DASHBOARD_FILE = os.path.join(ROOT, "deploy", "grafana", "dashboards", "tokenyard.json")
PROCESSES = ("api", "scheduler", "worker", "detokenizer")

_VARIABLE = re.compile(r"\$(?:\$|\{(?P<braced>\w+)(?::?-(?P<default>[^}]*))?\}|(?P<plain>\w+))")


def interpolate(value: Any) -> Any:
    """Compose's ``${VAR:-default}`` interpolation with every variable unset (``$$`` is a literal ``$``)."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: "$" if m.group(0) == "$$" else (m.group("default") or ""), value)
    if isinstance(value, list):
        return [interpolate(item) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item) for key, item in value.items()}
    return value


def load_yaml(path: str) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


def load_compose() -> dict[str, Any]:
    return interpolate(load_yaml(COMPOSE_FILE))


def load_dashboard() -> dict[str, Any]:
    with open(DASHBOARD_FILE) as f:
        return json.load(f)


def service_argv(service: dict[str, Any]) -> list[str]:
    """What the container runs: the entrypoint followed by the command."""
    parts = (service.get("entrypoint", []), service.get("command", []))
    return [arg for part in parts for arg in (part.split() if isinstance(part, str) else part)]


KEYS_COMMAND = ["python", "-m", "shared.transport", "keys"]


def tokenyard_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run a tokenyard image (each runs one process), less the one-shot that writes the CURVE keys."""
    return {
        name: service
        for name, service in compose["services"].items()
        if str(service.get("image", "")).startswith("tokenyard:") and service_argv(service)[:4] != KEYS_COMMAND
    }


def process_of(service: dict[str, Any]) -> str:
    """The process a service runs (``python -m services.<process>``), or "" for anything else."""
    argv = service_argv(service)
    if argv[:2] == ["python", "-m"] and len(argv) > 2 and argv[2].startswith("services."):
        return argv[2].removeprefix("services.")
    return ""


def flags_of(service: dict[str, Any]) -> list[str]:
    return service_argv(service)[3:]


def flag_names(flags: list[str]) -> list[str]:
    """Field names of ``--name=value`` and ``--name value`` flags."""
    return [flag[2:].split("=", 1)[0].replace("-", "_") for flag in flags if flag.startswith("--")]


def stack_config(service: dict[str, Any]) -> StackConfig:
    return StackConfig.from_argv(flags_of(service))


def host_names(name: str, service: dict[str, Any]) -> set[str]:
    """The names a service answers to on the compose network: its own and its aliases."""
    names = {name}
    networks = service.get("networks") or {}
    if isinstance(networks, dict):
        for network in networks.values():
            names.update((network or {}).get("aliases", []))
    return names


def prometheus_targets(config: dict[str, Any]) -> set[str]:
    """host:port of every static target and every DNS-discovered name."""
    static = {target for job in config["scrape_configs"] for static in job.get("static_configs", []) for target in static["targets"]}
    dns = {f"{name}:{sd['port']}" for job in config["scrape_configs"] for sd in job.get("dns_sd_configs", []) for name in sd["names"]}
    return static | dns


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query target of every panel, rows included."""
    found: list[tuple[str, str]] = []

    def visit(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            found.extend((panel.get("title", ""), target["expr"]) for target in panel.get("targets", []) if target.get("expr"))
            visit(panel.get("panels", []))

    visit(dashboard["panels"])
    return found
