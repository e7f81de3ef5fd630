"""Fixtures of the worker tests: the tiny Llama checkpoints, built once per session."""

from __future__ import annotations

import pytest

from .harness import TINY_LLAMAS, Checkpoint, build_tiny_llama


@pytest.fixture(scope="session")
def tiny_llamas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    root = tmp_path_factory.mktemp("tiny-llama")
    return {name: Checkpoint(str(root / name), build_tiny_llama(str(root / name), **kw)) for name, kw in TINY_LLAMAS.items()}


@pytest.fixture(params=list(TINY_LLAMAS))
def tiny(request: pytest.FixtureRequest, tiny_llamas: dict[str, Checkpoint]) -> Checkpoint:
    """Each tiny checkpoint in turn: untied, Llama 3 rope scaling, tied + sharded + explicit head_dim."""
    return tiny_llamas[request.param]
