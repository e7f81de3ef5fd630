"""The C++ kernels release the GIL while they compute, so that the worker's heartbeat thread keeps
reporting through a long step (a one-call decoder over a long prefill chunk runs for seconds on a slow
CPU, and a worker silent for --engine-timeout-s is taken for dead)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.worker import block_quant
from services.worker.cpu_kernels import cpu_kernels

kernels = pytest.mark.skipif(cpu_kernels()[0] is None, reason=f"CPU kernels unavailable: {cpu_kernels()[1]}")

LONG_CALL_S = 0.2  # long enough for a thread that wakes every millisecond to run many times, if it may


class Ticker:
    """A Python thread counting its wake-ups: it can only count while no other thread holds the GIL."""

    def __init__(self) -> None:
        self.ticks = 0
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopping:
            time.sleep(0.001)
            self.ticks += 1

    def __enter__(self) -> Ticker:
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stopping = True
        self.thread.join()


@kernels
def test_a_long_block_product_lets_other_python_threads_run() -> None:
    gemm = cpu_kernels()[0].block_quant_gemm
    out_features, in_features = 2048, 2048
    panels = block_quant.to_panels(block_quant.quantize(torch.randn(out_features, in_features), "q4_1"))
    rows = 256
    while True:  # as many rows as make one call last LONG_CALL_S on this machine
        x = torch.randn(rows, in_features)
        started = time.perf_counter()
        gemm(x, panels, out_features, None, None, 16)
        if time.perf_counter() - started >= LONG_CALL_S or rows >= 1 << 16:
            break
        rows *= 2
    with Ticker() as ticker:
        time.sleep(0.01)
        before = ticker.ticks
        started = time.perf_counter()
        gemm(x, panels, out_features, None, None, 16)
        took, ticked = time.perf_counter() - started, ticker.ticks - before
    # Holding the GIL, the call would let the ticker through at most once (at its start or end).
    assert ticked >= 5, f"a {took * 1000:.0f} ms kernel call let another Python thread run only {ticked} times"
