"""The launcher's children: one api, and per engine replica a scheduler, the worker's ranks and (with
``--detokenize-in detokenizer``) a detokenizer."""

from __future__ import annotations

import json
import socket

import pytest

from services.launcher.__main__ import child_argvs, listen_ports, main, ports_in_use, restart_group
from shared.config import DEFAULT_MODEL_DIR, StackConfig


def _config_of(argv: list[str]) -> StackConfig:
    return StackConfig.from_argv(argv[3:])


def test_two_replicas_of_two_ranks_each(tmp_path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128})
    )
    config = StackConfig(model=str(model), port=9000, run_dir=str(tmp_path / "run"), replicas=2, tensor_parallel_size=2)
    argvs = child_argvs(config)
    assert sorted(argvs) == sorted(["api"] + [f"{p}@engine-{i}" for i in (0, 1) for p in ("scheduler", "worker", "worker-rank1")])
    api = _config_of(argvs["api"])
    engines = api.engine_addresses
    assert list(engines) == ["engine-0", "engine-1"] and len(set(engines.values())) == 2
    for i in (0, 1):
        scheduler, worker, rank1 = (_config_of(argvs[f"{p}@engine-{i}"]) for p in ("scheduler", "worker", "worker-rank1"))
        assert scheduler.scheduler_address == engines[f"engine-{i}"] == worker.scheduler_address
        assert scheduler.api_address == api.api_address  # replies reach the one api
        assert scheduler.metrics_port("scheduler") == 9001 + 3 * i and worker.metrics_port("worker") == 9002 + 3 * i
        assert (worker.tensor_parallel_rank, rank1.tensor_parallel_rank) == (0, 1)
        assert scheduler.metric_labels["replica"] == f"engine-{i}"
        assert worker.tensor_parallel_init == rank1.tensor_parallel_init == f"tcp://127.0.0.1:{9090 + i}"
    assert restart_group("worker-rank1@engine-1") == restart_group("worker@engine-1") != restart_group("worker@engine-0")
    assert restart_group("scheduler@engine-1") == "scheduler@engine-1"


@pytest.mark.parametrize(
    ("detokenize_in", "processes"), [("api", ["api", "scheduler", "worker"]), ("detokenizer", ["api", "detokenizer", "scheduler", "worker"])]
)
def test_one_replica_keeps_its_processes_and_their_flags(detokenize_in: str, processes: list[str]) -> None:
    config = StackConfig(port=9000, detokenize_in=detokenize_in)
    argvs = child_argvs(config)
    assert sorted(argvs) == processes
    assert all(_config_of(argv) == config for argv in argvs.values())


def test_a_model_that_cannot_be_split_is_refused_at_once(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "num_attention_heads": 4, "intermediate_size": 8}))
    with pytest.raises(SystemExit, match="qwen3_next"):
        child_argvs(StackConfig(model=str(tmp_path), tensor_parallel_size=2))


def test_speculation_starts_for_a_hybrid_model_but_not_under_tensor_parallelism(tmp_path) -> None:
    config = {"model_type": "qwen3_next", "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert child_argvs(StackConfig(model=str(tmp_path), speculative_method="ngram"))
    with pytest.raises(SystemExit, match="tensor parallelism"):
        child_argvs(StackConfig(model=str(tmp_path), speculative_method="ngram", tensor_parallel_size=2))


def test_mtp_speculation_is_refused_at_once_for_a_family_without_an_mtp_layer(tmp_path) -> None:
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match="a llama model has none"):
        child_argvs(StackConfig(model=str(tmp_path), speculative_method="mtp"))
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_next"}))
    assert child_argvs(StackConfig(model=str(tmp_path), speculative_method="mtp"))


@pytest.mark.parametrize(
    "config_json, reason",
    [
        (None, "is not a model directory: it has no config.json"),
        ("{not json", "its config.json is not valid JSON"),
        ('{"model_type": "llama"}', "its config.json has no 'num_attention_heads'"),
    ],
)
def test_a_directory_that_is_no_model_is_refused_in_one_line_before_anything_starts(tmp_path, capsys, monkeypatch, config_json, reason) -> None:
    started: list[object] = []
    monkeypatch.setattr("services.launcher.__main__.Launcher.start", lambda self: started.append(self))
    model = tmp_path / "m"
    model.mkdir()
    if config_json is not None:
        (model / "config.json").write_text(config_json)
    assert main(["--model", str(model), "--port", "9000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"tokenyard: cannot serve --model {model}: ") and reason in err and "\n" not in err
    assert started == []


def test_the_ports_the_children_listen_on_are_each_replicas_own(tmp_path) -> None:
    config = StackConfig(model=DEFAULT_MODEL_DIR, port=9000, run_dir=str(tmp_path / "run"), replicas=2, detokenize_in="detokenizer")
    ports = listen_ports(child_argvs(config))
    assert ports[0] == ("api", "127.0.0.1", 9000)
    assert {what for what, _, _ in ports} == {"api"} | {f"{p}@engine-{i} metrics" for i in (0, 1) for p in ("scheduler", "worker", "detokenizer")}
    assert len({port for _, _, port in ports}) == len(ports)  # no two children on one port


def test_a_port_already_listened_on_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch) -> None:
    started: list[object] = []
    monkeypatch.setattr("services.launcher.__main__.Launcher.start", lambda self: started.append(self))
    with socket.socket() as other:  # another server on what would be the scheduler's metrics port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        assert ports_in_use([("scheduler metrics", "127.0.0.1", port)]) == [f"127.0.0.1:{port} (scheduler metrics)"]
        assert main(["--port", str(port - 1), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tokenyard: already in use: ") and f"127.0.0.1:{port} (scheduler metrics)" in err and "\n" not in err
    assert started == []
    assert ports_in_use([("api", "127.0.0.1", port)]) == []  # free again once the other server closed
