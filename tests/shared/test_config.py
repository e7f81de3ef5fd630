"""The settings: their groups, flags, bounds and choices, and those that are more than one flag each."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass

import pytest

from shared.choices import keyed_by
from shared.config import GROUPS, UNGROUPED, StackConfig, _opt, setting_groups


def test_keys_come_from_repeated_flags_commas_and_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("TOKENYARD_API_KEY", "from-env")
    config = StackConfig.from_argv(["--api-key", "a,b", "--api-key", "c"])
    assert config.api_keys == ("a", "b", "c", "from-env")
    assert "a,b,c" not in " ".join(config.to_argv())  # keys never reach a child's argv
    monkeypatch.delenv("TOKENYARD_API_KEY")
    assert StackConfig.from_argv([]).api_keys == ()


def test_every_setting_is_defined_once_in_its_group_and_read_flat() -> None:
    names = [f.name for group in GROUPS for f in dataclasses.fields(group)]
    assert len(names) == len(set(names))
    assert names == [f.name for f in dataclasses.fields(StackConfig)]  # StackConfig adds none of its own
    assert [title for title, _ in setting_groups()] == ["Model", "HTTP api", "ZMQ transport", "Scheduler", "Worker", "Processes", "Logging"]
    config = StackConfig.from_argv(["--heartbeat-s", "0.2", "--block-size", "16", "--weight-quant", "int4"])
    assert (config.heartbeat_s, config.block_size, config.weight_quant) == (0.2, 16, "int4")


def test_help_lists_every_flag_under_its_group(capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        StackConfig.from_argv(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    for title, fields in setting_groups():
        section = out.split(f"\n{title}:\n")[1].split("\n\n")[0]
        assert all(f"--{f.name.replace('_', '-')}" in section for f in fields), title
    assert "--router-policy {load,prefix,round_robin}" in out  # a choice's values, in the usage and its entry


def test_every_help_is_one_short_line() -> None:
    # the trade-offs of a setting are told in docs/configuration.md, not in its help
    long = [f.name for f in dataclasses.fields(StackConfig) if "\n" in f.metadata["help"] or len(f.metadata["help"]) > 100]
    assert not long


def test_a_setting_outside_the_groups_still_gets_its_flag_and_a_percent_in_help(capsys) -> None:
    # argparse formats help text with %: a literal "%" in a setting's text must not crash any service's --help.
    @dataclass(frozen=True)
    class Extended(StackConfig):
        share: str = _opt("", "a +1.7 % share")

    assert Extended.from_argv(["--share", "x"]).share == "x"
    with pytest.raises(SystemExit):
        Extended.from_argv(["--help"])
    assert f"{UNGROUPED}: --share SHARE a +1.7 % share" in " ".join(capsys.readouterr().out.split())


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
    # the choices come from shared/choices.py, whose names the registries must be keyed by (keyed_by)
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


def test_a_registry_keyed_otherwise_than_its_settings_choices_is_refused() -> None:
    assert keyed_by(("a", "b"), {"a": 1, "b": 2}) == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match="shared/choices.py"):
        keyed_by(("a", "b"), {"a": 1, "c": 2})


def test_the_configuration_imports_no_service_nor_heavy_library() -> None:
    # every process imports shared/config.py; the registries' names are in shared/choices.py for this
    code = "import sys, shared.config; print(sorted(m for m in sys.modules if m.split('.')[0] in ('services', 'torch', 'aiohttp')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
