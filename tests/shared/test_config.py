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
    # argparse formats help text with %: a literal "%" in a setting's text once crashed every service's --help.
    with pytest.raises(SystemExit) as exit:
        StackConfig.from_argv(["--help"])
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "+0.8 % perplexity" in text
    assert all(f"--{f.name.replace('_', '-')}" in text for f in dataclasses.fields(StackConfig))


@pytest.mark.parametrize("service", ["api", "scheduler", "worker", "detokenizer", "launcher"])
def test_every_service_answers_help(service: str) -> None:
    done = subprocess.run([sys.executable, "-m", f"services.{service}", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "--weight-quant" in done.stdout
