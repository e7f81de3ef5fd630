"""deploy/k8s: every overlay renders with `kubectl kustomize`, validates against the Kubernetes schemas, runs
each process with flags the stack's own StackConfig parses and agrees on, wires every address to a Service
(or the LeaderWorkerSet leader) it defines, and passes checkov's policy checks with every skip explained."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from urllib.parse import urlparse

import pytest
import yaml

from shared.config import API_KEY_ENV, StackConfig
from tests.deploy.files import ROOT

K8S = os.path.join(ROOT, "deploy", "k8s")
OVERLAYS = ("cpu", "gpu", "replicas", "tensor-parallel")
KUBERNETES_VERSION = "1.30.0"  # the oldest release the manifests target (LeaderWorkerSet needs 1.26, preStop sleep is not used)
WORKLOADS = ("Deployment", "StatefulSet")
# Values the kubelet (or the LeaderWorkerSet controller) puts in $(VAR) of a container's args.
SAMPLE_ENV = {"POD_NAME": "pod-0", "POD_IP": "10.0.0.7", "LWS_LEADER_ADDRESS": "tokenyard-tp-0.tokenyard-tp.tokenyard", "LWS_WORKER_INDEX": "1"}
LWS_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_ENV = {"LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX", "LWS_GROUP_SIZE", "LWS_NAME"}
# What a process may set for itself: its own inboxes and names, the api's view of the engines, its rank.
PER_PROCESS = {
    "api_addr",
    "scheduler_addr",
    "worker_addr",
    "detokenizer_addr",
    "api_replica",
    "engine_name",
    "engines",
    "engines_from_dns",
    "tensor_parallel_rank",
    "tensor_parallel_addr",
}
FIELDS = {f.name for f in dataclasses.fields(StackConfig)}
# No package reachable from here ships the published OpenAPI schemas of these CRDs (PyPI, Debian and npm
# carry none for LeaderWorkerSet; npm's @kubernetes-models/prometheus-operator carries compiled validators
# only), so kubernetes-validate skips these kinds; the tests below check what the stack relies on in them,
# and a LeaderWorkerSet's pod templates are validated as core PodTemplates.
CRD_KINDS = {("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"), ("monitoring.coreos.com/v1", "PodMonitor")}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: it renders the overlays (kubectl kustomize)")
    out = {}
    for overlay in OVERLAYS:
        text = subprocess.run(["kubectl", "kustomize", os.path.join(K8S, "overlays", overlay)], capture_output=True, text=True, check=True).stdout
        out[overlay] = [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc


def pod_templates(docs: list[dict]) -> list[tuple[str, dict]]:
    """(where, pod template) of every workload: Deployments, StatefulSets, and a LeaderWorkerSet's leader and workers."""
    found = [(f"{doc['kind']}/{doc['metadata']['name']}", doc["spec"]["template"]) for doc in docs if doc["kind"] in WORKLOADS]
    for lws in of_kind(docs, "LeaderWorkerSet"):
        template = lws["spec"]["leaderWorkerTemplate"]
        for part, index in (("leaderTemplate", "0"), ("workerTemplate", "1")):  # the controller labels each pod with its index
            pod = copy.deepcopy(template[part])
            pod["metadata"]["labels"] = {**pod["metadata"].get("labels", {}), LWS_INDEX_LABEL: index}
            found.append((f"LeaderWorkerSet/{lws['metadata']['name']}/{part}", pod))
    return found


def process_of(container: dict) -> str:
    command = container.get("command", [])
    return command[2].removeprefix("services.") if command[:2] == ["python", "-m"] and command[2].startswith("services.") else ""


def expanded_args(container: dict, where: str) -> list[str]:
    """The container's args as the kubelet expands them; a $(VAR) it could not expand fails the test."""
    declared = {env["name"] for env in container.get("env", [])} | (LWS_ENV if where.startswith("LeaderWorkerSet") else set())
    args = container.get("args", [])
    for var in re.findall(r"\$\((\w+)\)", " ".join(args)):
        assert var in declared, f"{where} {container['name']}: $({var}) is not in its env"
    return [re.sub(r"\$\((\w+)\)", lambda m: SAMPLE_ENV[m.group(1)], arg) for arg in args]


def processes(docs: list[dict]) -> list[tuple[str, dict, dict, StackConfig]]:
    """(where, pod template, container, its StackConfig) for every tokenyard process container."""
    out = []
    for where, template in pod_templates(docs):
        for container in template["spec"]["containers"]:
            assert process_of(container), f"{where} {container['name']} runs {container.get('command')}, not python -m services.<process>"
            try:
                config = StackConfig.from_argv(expanded_args(container, where))
            except SystemExit:
                pytest.fail(f"{where} {container['name']}: its args do not parse: {container.get('args')}")
            out.append((where, template, container, config))
    return out


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def container_ports(template: dict) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for c in template["spec"]["containers"] for port in c.get("ports", []) if "name" in port}


# Schemas. ------------------------------------------------------------------------------------


def test_every_overlay_validates_against_the_kubernetes_schemas(rendered) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the test extra) is not installed")
    for overlay, docs in rendered.items():
        for doc in docs:
            where = f"{overlay}: {doc['kind']}/{doc['metadata']['name']}"
            if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
                continue
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where}: {exc.message} at {'/'.join(map(str, exc.path))}")
        for where, template in pod_templates(docs):
            if where.startswith("LeaderWorkerSet"):
                pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "lws"}, "template": template}
                kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)
        assert {kind for kind in CRD_KINDS if any((d["apiVersion"], d["kind"]) == kind for d in docs)} <= CRD_KINDS


# Processes and their flags. -------------------------------------------------------------------


def test_every_process_parses_its_flags_and_agrees_with_the_others(rendered) -> None:
    for overlay, docs in rendered.items():
        found = processes(docs)
        by_process = {process_of(c) for _, _, c, _ in found}
        assert {"api", "scheduler", "worker"} <= by_process, f"{overlay} runs {by_process}"
        reference = next(config for _, _, c, config in found if process_of(c) == "api")
        for where, _, container, config in found:
            differing = {f: (getattr(config, f), getattr(reference, f)) for f in FIELDS - PER_PROCESS if getattr(config, f) != getattr(reference, f)}
            assert not differing, f"{overlay}: {where} {container['name']} disagrees with the api on {differing}"
        detokenizers = [c for _, _, c, _ in found if process_of(c) == "detokenizer"]
        assert bool(detokenizers) == (reference.detokenize_in == "detokenizer"), f"{overlay}: a detokenizer container runs iff --detokenize-in detokenizer"


def test_each_engine_pod_holds_one_replica_and_binds_what_its_peers_reach(rendered) -> None:
    for overlay, docs in rendered.items():
        for where, template, container, config in processes(docs):
            process = process_of(container)
            if process == "api":
                assert config.api_address == f"tcp://{SAMPLE_ENV['POD_IP']}:{container_ports(template)['zmq']}", (
                    f"{overlay}: the api binds its inbox on its pod's address"
                )
                assert config.api_replica == SAMPLE_ENV["POD_NAME"], f"{overlay}: each api replica names itself by its pod"
                continue
            if config.tensor_parallel_rank > 0:
                continue  # a follower rank reaches rank 0 only
            names = {c["name"] for c in template["spec"]["containers"]}
            assert {"scheduler", "worker"} <= names, f"{overlay}: {where} runs the scheduler and worker of one replica together"
            assert config.scheduler_address == f"tcp://{SAMPLE_ENV['POD_IP']}:{container_ports(template)['zmq']}", f"{overlay}: {where}"
            for inbox in (config.worker_address, config.detokenizer_address):  # within the pod
                assert urlparse(inbox).hostname == "127.0.0.1", f"{overlay}: {where} {container['name']}: {inbox}"
            assert config.engine_name == SAMPLE_ENV["POD_NAME"], f"{overlay}: {where} names its metrics' replica by its pod"


def test_the_api_finds_the_engines_and_the_engines_find_the_api_through_services(rendered) -> None:
    for overlay, docs in rendered.items():
        found = processes(docs)
        services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
        (api,) = [(t, config) for _, t, c, config in found if process_of(c) == "api"]
        api_template, api_config = api
        host, port = api_config.engines_dns_target
        service = services.get(host)
        assert service is not None, f"{overlay}: --engines-from-dns names {host!r}, which is no Service of the overlay"
        assert service["spec"].get("clusterIP") == "None" and service["spec"].get("publishNotReadyAddresses"), f"{overlay}: {host} must be headless"
        schedulers = [(t, config) for _, t, c, config in found if process_of(c) == "scheduler"]
        assert schedulers
        for template, config in schedulers:
            assert selects(service["spec"]["selector"], template["metadata"]["labels"]), f"{overlay}: {host} does not select the scheduler's pods"
            assert urlparse(config.scheduler_address).port == port
        selected = [t for _, t in pod_templates(docs) if selects(service["spec"]["selector"], t["metadata"]["labels"])]
        assert all(any(process_of(c) == "scheduler" for c in t["spec"]["containers"]) for t in selected), f"{overlay}: {host} selects pods with no scheduler"
        for _, _, container, config in found:
            if process_of(container) != "api":
                target = urlparse(config.api_address)
                api_service = services[target.hostname]
                assert selects(api_service["spec"]["selector"], api_template["metadata"]["labels"])
                assert target.port in {p["port"] for p in api_service["spec"]["ports"]}


def test_tensor_parallel_ranks_meet_at_the_leaderworkerset_leader(rendered) -> None:
    docs = rendered["tensor-parallel"]
    assert not of_kind(docs, "StatefulSet"), "the LeaderWorkerSet replaces the engine StatefulSet"
    (lws,) = of_kind(docs, "LeaderWorkerSet")
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    ranks = {}
    for where, template, container, config in processes(docs):
        assert config.tensor_parallel_size == size, f"{where} {container['name']}"
        if process_of(container) == "worker":
            raw = next(arg for arg in container["args"] if arg.startswith("--tensor-parallel-addr="))
            assert urlparse(raw.split("=", 1)[1].replace("$(LWS_LEADER_ADDRESS)", "leader")).hostname == "leader", "ranks meet at $(LWS_LEADER_ADDRESS)"
            ranks[where.rsplit("/", 1)[1]] = (template, container, config)
    leader_template, _, leader = ranks["leaderTemplate"]
    _, follower_container, follower = ranks["workerTemplate"]
    assert leader.tensor_parallel_rank == 0 and "--tensor-parallel-rank=$(LWS_WORKER_INDEX)" in follower_container["args"]
    assert urlparse(leader.tensor_parallel_init).port in container_ports(leader_template).values()
    assert leader.tensor_parallel_init == follower.tensor_parallel_init


# Model, secrets, lifecycle, resources. ------------------------------------------------------------


def test_the_model_comes_from_the_pvc_and_keys_from_secrets(rendered) -> None:
    for overlay, docs in rendered.items():
        claims = {pvc["metadata"]["name"] for pvc in of_kind(docs, "PersistentVolumeClaim")}
        for where, template, container, config in processes(docs):
            volumes = {v["name"]: v for v in template["spec"]["volumes"]}
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            model_mount = next(m for path, m in mounts.items() if config.model.startswith(path.rstrip("/") + "/"))
            assert volumes[model_mount["name"]]["persistentVolumeClaim"]["claimName"] in claims and model_mount["readOnly"], f"{overlay}: {where}"
            key_mount = mounts[os.path.dirname(config.curve_key_file)]
            assert "secret" in volumes[key_mount["name"]] and key_mount["readOnly"], f"{overlay}: {where}: the CURVE key comes from a Secret"
            assert not config.api_key, f"{overlay}: {where}: API keys never go in args"
            prepare = [c for c in template["spec"].get("initContainers", []) if c["name"] == "prepare-model"]
            assert prepare and '--out "$model"' in prepare[0]["args"][0] and f"model={config.model}\n" in prepare[0]["args"][0], f"{overlay}: {where}"
        api = next(c for _, _, c, _ in processes(docs) if process_of(c) == "api")
        (key_env,) = [env for env in api["env"] if env["name"] == API_KEY_ENV]
        assert "secretKeyRef" in key_env["valueFrom"]


def test_the_api_drains_before_it_is_killed_and_loading_never_fails_liveness(rendered) -> None:
    for overlay, docs in rendered.items():
        api = named(docs, "Deployment", "tokenyard-api")["spec"]["template"]
        (container,) = api["spec"]["containers"]
        config = StackConfig.from_argv(expanded_args(container, "api"))
        pause = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        assert api["spec"]["terminationGracePeriodSeconds"] > pause + config.drain_timeout_s, overlay
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert container["livenessProbe"]["httpGet"]["path"] != "/health", "/health is 503 while no engine is ready: liveness must not restart the api for it"
        for where, _, container, _ in processes(docs):
            liveness = container.get("livenessProbe")
            if liveness and liveness["httpGet"]["path"] == "/health":  # 503 while loading: a startup probe covers it
                assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 300, f"{overlay}: {where}"


def test_every_container_has_requests_and_limits_and_gpu_workers_ask_for_a_gpu(rendered) -> None:
    for overlay, docs in rendered.items():
        for where, template in pod_templates(docs):
            for container in template["spec"]["containers"] + template["spec"].get("initContainers", []):
                resources = container.get("resources", {})
                assert {"cpu", "memory"} <= set(resources.get("requests", {})) and {"cpu", "memory"} <= set(resources.get("limits", {})), (
                    f"{overlay}: {where} {container['name']}"
                )
                gpu = overlay in ("gpu", "tensor-parallel")
                assert container["image"] == ("tokenyard:cuda" if gpu else "tokenyard:cpu"), f"{overlay}: {where} {container['name']}"
                if gpu and process_of(container) == "worker":
                    assert resources["limits"]["nvidia.com/gpu"] == "1" and template["spec"]["nodeSelector"] and template["spec"]["tolerations"]
        assert {pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for pdb in of_kind(docs, "PodDisruptionBudget")} == {"api", "engine"}


def test_pod_monitors_scrape_every_metrics_port(rendered) -> None:
    for overlay, docs in rendered.items():
        monitors = of_kind(docs, "PodMonitor")
        for _, template, container, config in processes(docs):
            process = process_of(container)
            if config.tensor_parallel_rank > 0:
                continue  # a follower rank serves no metrics
            (port,) = [p for p in container["ports"] if p["containerPort"] == config.metrics_port(process)]
            scraped = [
                m
                for m in monitors
                if selects(m["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])
                and port["name"] in {e["port"] for e in m["spec"]["podMetricsEndpoints"]}
            ]
            assert scraped, f"{overlay}: no PodMonitor scrapes {process}'s metrics port {port['name']}"


def test_the_autoscaler_scales_the_engines_on_the_schedulers_waiting_queue(rendered) -> None:
    from services.scheduler.loop import WAITING

    docs = rendered["replicas"]
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert named(docs, target["kind"], target["name"])["spec"]["replicas"] >= hpa["spec"]["minReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == WAITING._name, "the HPA's metric is the scheduler's waiting-queue gauge"


# Policy. ----------------------------------------------------------------------------------------


def _checkov() -> str | None:
    for candidate in (os.path.join(ROOT, ".venv-tools", "bin", "checkov"), os.path.join(os.path.dirname(sys.executable), "checkov"), shutil.which("checkov")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def test_checkov_finds_nothing_and_every_skip_gives_its_reason(rendered, tmp_path) -> None:
    # checkov pins dependencies older than ours (packaging, networkx), so it lives in .venv-tools:
    #   python3 -m venv .venv-tools && .venv-tools/bin/pip install checkov==3.3.30
    checkov = _checkov()
    if checkov is None:
        pytest.skip("checkov is not installed (python3 -m venv .venv-tools && .venv-tools/bin/pip install checkov==3.3.30)")
    for overlay, docs in rendered.items():
        (tmp_path / f"{overlay}.yaml").write_text(yaml.safe_dump_all(copy.deepcopy(docs)))
    run = subprocess.run(
        [checkov, "-d", str(tmp_path), "--framework", "kubernetes", "--compact", "--skip-download", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    reports = json.loads(run.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [(f["check_id"], f["resource"], f["file_path"]) for r in reports for f in r["results"].get("failed_checks", [])]
    assert not failed, f"checkov: {failed}"
    skipped = {s["check_id"] for r in reports for s in r["results"].get("skipped_checks", [])}
    # A skip is an annotation checkov.io/skipN: CHECK_ID=reason on the resource; its report omits the reason.
    reasons: dict[str, str] = {}
    for docs in rendered.values():
        for doc in docs:
            for key, value in doc["metadata"].get("annotations", {}).items():
                if key.startswith("checkov.io/skip"):
                    check, _, reason = value.partition("=")
                    assert len(reason.split()) >= 4, f"{doc['kind']}/{doc['metadata']['name']}: checkov skip {value!r} gives no reason"
                    reasons[check] = reason
    assert skipped and skipped <= set(reasons), f"checkov skipped {sorted(skipped - set(reasons))} without an annotation of ours"
