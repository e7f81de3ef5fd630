"""Settings that are more than one flag each: repeatable, secret, from the environment."""

from __future__ import annotations

from shared.config import StackConfig


def test_keys_come_from_repeated_flags_commas_and_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("TOKENYARD_API_KEY", "from-env")
    config = StackConfig.from_argv(["--api-key", "a,b", "--api-key", "c"])
    assert config.api_keys == ("a", "b", "c", "from-env")
    assert "a,b,c" not in " ".join(config.to_argv())  # keys never reach a child's argv
    monkeypatch.delenv("TOKENYARD_API_KEY")
    assert StackConfig.from_argv([]).api_keys == ()
