"""Markers of the deployment tests."""

from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "docker: builds images and runs containers; skipped when no Docker engine answers")
