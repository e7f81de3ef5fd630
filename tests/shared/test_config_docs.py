"""docs/configuration.md documents every setting as shared/config.py defines it."""

from __future__ import annotations

import dataclasses

from shared import config_docs
from shared.config import StackConfig, setting_groups


def _committed() -> str:
    with open(config_docs.DOC_PATH, encoding="utf-8") as f:
        return f.read()


def test_the_committed_settings_tables_are_the_generated_ones() -> None:
    committed = _committed()
    assert committed == config_docs.render(committed), (
        f"docs/configuration.md differs from shared/config.py: run `{config_docs.COMMAND}` and commit docs/configuration.md"
    )


def test_every_setting_has_its_readers() -> None:
    missing = [f.name for f in dataclasses.fields(StackConfig) if f.name not in config_docs.READERS]
    assert not missing, f"add {missing} to READERS in shared/config_docs.py (the processes that read each), then run `{config_docs.COMMAND}`"
    assert set(config_docs.READERS) <= {f.name for f in dataclasses.fields(StackConfig)}


def test_the_sections_are_the_groups_of_settings() -> None:
    headings = [
        line.removeprefix("### ") for line in _committed().split(config_docs.BEGIN)[1].split(config_docs.END)[0].splitlines() if line.startswith("### ")
    ]
    assert headings == [title for title, _ in setting_groups()]


def test_each_setting_is_one_row_with_its_flag_default_and_bounds() -> None:
    text = _committed()
    for f in dataclasses.fields(StackConfig):
        rows = [line for line in text.splitlines() if line.startswith(f"| `--{f.name.replace('_', '-')}` |")]
        assert len(rows) == 1, f.name
    assert "| `--port` | `8000` | int ≥ 1 |" in text
    assert "| `--router-policy` | `load` | `load`, `prefix`, `round_robin` |" in text
    assert "| `--enable-prefix-cache` | `true` | `true` / `false` |" in text
