"""docs/configuration.md documents every setting as shared/config.py defines it."""

from __future__ import annotations

import dataclasses

from shared import config_docs
from shared.config import StackConfig


def _committed() -> str:
    with open(config_docs.DOC_PATH, encoding="utf-8") as f:
        return f.read()


def test_the_committed_settings_tables_are_the_generated_ones() -> None:
    committed = _committed()
    assert committed == config_docs.render(committed), (
        f"docs/configuration.md differs from shared/config.py: run `{config_docs.COMMAND}` and commit docs/configuration.md"
    )


def test_every_setting_has_a_section_and_its_readers() -> None:
    placed = {name for rows in config_docs.SECTIONS.values() for name in rows}
    unplaced = [f.name for f in dataclasses.fields(StackConfig) if f.name not in placed]
    assert not unplaced, f"add {unplaced} to SECTIONS in shared/config_docs.py (the processes that read each), then run `{config_docs.COMMAND}`"


def test_each_setting_is_one_row_with_its_flag_default_and_bounds() -> None:
    text = _committed()
    for f in dataclasses.fields(StackConfig):
        rows = [line for line in text.splitlines() if line.startswith(f"| `--{f.name.replace('_', '-')}` |")]
        assert len(rows) == 1, f.name
    assert "| `--port` | `8000` | int ≥ 1 |" in text
    assert "| `--router-policy` | `load` | `load`, `prefix`, `round_robin` |" in text
    assert "| `--enable-prefix-cache` | `true` | `true` / `false` |" in text
