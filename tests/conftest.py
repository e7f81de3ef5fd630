"""What every test shares: the process's collector set for a long run of tests."""

from __future__ import annotations

import gc

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    """Moves what the imports and the collection made (~0.8M objects: torch, transformers, the test modules) out of the
    collector's reach: a full collection then scans only what the tests have made since, instead of taking ~0.5 s
    (a test module that collects after each example or model load paid over a minute for it)."""
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Back within reach at the end, so that the interpreter's exit finalizes them (extensions count leaks otherwise)."""
    gc.unfreeze()
