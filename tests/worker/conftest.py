"""Fixtures of the worker tests: tiny random checkpoints of each family, built once per session when first asked for."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from multiprocessing.pool import Pool

import pytest
import torch

from .harness import TINY_LLAMAS, TINY_QWEN3_MOES, TINY_QWEN3_NEXTS, TINY_QWEN3S, Checkpoint, build_tiny


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """For modules of tiny models, which compute in microseconds per op: two threads on a busy machine spend
    it waiting on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _build(factory: pytest.TempPathFactory, family: str, variants: dict[str, dict]) -> dict[str, Checkpoint]:
    root = factory.mktemp(f"tiny-{family}")
    return {name: Checkpoint(str(root / name), build_tiny(family, str(root / name), **kw)) for name, kw in variants.items()}


@pytest.fixture(scope="session")
def tiny_llamas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    return _build(tmp_path_factory, "llama", TINY_LLAMAS)


@pytest.fixture(scope="session")
def tiny_qwen3s(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    return _build(tmp_path_factory, "qwen3", TINY_QWEN3S)


@pytest.fixture(scope="session")
def tiny_qwen3_moes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    return _build(tmp_path_factory, "qwen3_moe", TINY_QWEN3_MOES)


@pytest.fixture(params=list(TINY_LLAMAS))
def tiny(request: pytest.FixtureRequest, tiny_llamas: dict[str, Checkpoint]) -> Checkpoint:
    """Each tiny Llama in turn: untied, Llama 3 rope scaling, tied + sharded + explicit head_dim."""
    return tiny_llamas[request.param]


@pytest.fixture(params=list(TINY_QWEN3S))
def tiny_qwen3(request: pytest.FixtureRequest, tiny_qwen3s: dict[str, Checkpoint]) -> Checkpoint:
    """Each tiny Qwen3 in turn: untied with q/k/v/o biases and head_dim 32 of hidden 64 / 4 heads; tied + sharded."""
    return tiny_qwen3s[request.param]


@pytest.fixture(params=list(TINY_QWEN3_MOES))
def tiny_qwen3_moe(request: pytest.FixtureRequest, tiny_qwen3_moes: dict[str, Checkpoint]) -> Checkpoint:
    """Each tiny Qwen3-MoE in turn: top-2 renormalised with a dense middle layer; top-3 raw in every second layer, tied."""
    return tiny_qwen3_moes[request.param]


@pytest.fixture(scope="session")
def tiny_qwen3_nexts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    return _build(tmp_path_factory, "qwen3_next", TINY_QWEN3_NEXTS)


@pytest.fixture(params=list(TINY_QWEN3_NEXTS))
def tiny_qwen3_next(request: pytest.FixtureRequest, tiny_qwen3_nexts: dict[str, Checkpoint]) -> Checkpoint:
    """Each tiny Qwen3-Next in turn: grouped GDN heads with a dense layer and half rotary; every second layer full attention, tied, biased."""
    return tiny_qwen3_nexts[request.param]


@pytest.fixture(scope="session")
def interpreter() -> Iterator[Pool]:
    """One worker process whose environment has TRITON_INTERPRET=1 from its first import: ``triton.jit``
    reads it when a kernel is decorated, so the kernel tests run their Triton calls there."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pool = multiprocessing.get_context("spawn").Pool(1)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    with pool:
        yield pool
