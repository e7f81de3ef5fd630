"""Settings that are more than one flag each: repeatable, secret, from the environment."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from shared.config import StackConfig


def test_keys_come_from_repeated_flags_commas_and_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("TOKENYARD_API_KEY", "from-env")
    config = StackConfig.from_argv(["--api-key", "a,b", "--api-key", "c"])
    assert config.api_keys == ("a", "b", "c", "from-env")
    assert "a,b,c" not in " ".join(config.to_argv())  # keys never reach a child's argv
    monkeypatch.delenv("TOKENYARD_API_KEY")
    assert StackConfig.from_argv([]).api_keys == ()


def test_help_lists_every_flag_with_its_text_as_written(capsys) -> None:
    # argparse formats help text with %: a literal "%" in a setting's text must not crash any service's --help.
    with pytest.raises(SystemExit) as exit:
        StackConfig.from_argv(["--help"])
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "+1.7 % perplexity" in text
    assert all(f"--{f.name.replace('_', '-')}" in text for f in dataclasses.fields(StackConfig))


@pytest.mark.parametrize("service", ["api", "scheduler", "worker", "detokenizer", "launcher"])
def test_every_service_answers_help(service: str) -> None:
    done = subprocess.run([sys.executable, "-m", f"services.{service}", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "--weight-quant" in done.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--weight-quant", "int3"], "argument --weight-quant: expected one of 'auto', 'none', 'fp16', 'int8', 'int4', 'int4-a8', got 'int3'"),
        (["--router-policy", "random"], "argument --router-policy: expected one of"),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: expected at least 1, got '0'"),
        (["--port", "-5"], "argument --port: expected at least 1, got '-5'"),
        (["--heartbeat-s", "0"], "argument --heartbeat-s: expected at least 0.01, got '0'"),
        (["--block-size", "eight"], "argument --block-size: invalid int value: 'eight'"),
    ],
)
def test_a_value_outside_a_settings_bounds_is_refused_naming_the_flag(capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit:
        StackConfig.from_argv(argv)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_the_settings_choices_are_what_the_services_accept() -> None:
    # weight_quant, device and kv_cache_dtype take their choices from the constants the services check against
    from services.api.reasoning import REASONING_PARSERS
    from services.api.router import POLICIES
    from services.api.tool_parsers import TOOL_PARSERS
    from services.worker.runner import DTYPES

    choices = {f.name: set(f.metadata["choices"]) for f in dataclasses.fields(StackConfig)}
    assert choices["dtype"] == {"auto", *DTYPES}
    assert choices["router_policy"] == set(POLICIES)
    assert choices["tool_call_parser"] == {"", "none", *TOOL_PARSERS}  # "": the model's own
    assert choices["reasoning_parser"] == {"", "none", *REASONING_PARSERS}
    for name in ("weight_quant", "device", "log_level", "log_format"):
        assert StackConfig.from_argv([f"--{name.replace('_', '-')}", getattr(StackConfig, name)]) == StackConfig()
