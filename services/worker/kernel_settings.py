"""The C++ CPU kernels' process-wide settings for a loaded model: whether few-row calls run on the
takeover pool (``csrc/takeover_pool.h``) and up to how many rows, and whether the int4 products'
prefetch keeps the weights in the caches (``cpu_cache.py``).

They choose threads and cache hints, never a result. A runner applies its settings once, at load: a
worker process holds one runner. A process that holds runners of several formats (tests, benchmarks
comparing formats) calls ``ModelRunner.apply_kernel_settings()`` before timing or counting the pool
use of a runner that was not the last one loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.worker.cpu_cache import keep_weights_cached, l3_cache_bytes
from services.worker.cpu_kernels import cpu_kernels
from services.worker.linear import held_bytes, linears_of


@dataclass(frozen=True)
class CpuKernelSettings:
    takeover_pool: bool
    pool_max_rows: int
    keep_weights_cached: bool
    weight_prefetch: str  # the prefetch's choice and why, for /instrumentation

    @classmethod
    def for_model(cls, model: Any, one_call: bool, weight_prefetch: str) -> CpuKernelSettings | None:
        """A CPU model's settings (None where the C++ kernels did not build). Decode-sized steps (up to the pool's
        limit) run on the pool where all their parallel kernels do: where every step runs all layers in one call
        (``one_call``), not where the per-layer path's torch glue may wake OpenMP's threads. ``weight_prefetch``:
        auto, keep or stream."""
        kernels = cpu_kernels()[0]
        if kernels is None:
            return None
        panels = sum(held_bytes(linear)["panels"] for linear in linears_of(model))
        keep, why = keep_weights_cached(weight_prefetch, panels, l3_cache_bytes())
        return cls(one_call, kernels.TAKEOVER_POOL_MAX_ROWS, keep, why)

    def apply(self) -> None:
        kernels = cpu_kernels()[0]
        kernels.set_takeover_pool(self.takeover_pool, self.pool_max_rows)
        kernels.set_weight_prefetch_keep(self.keep_weights_cached)
