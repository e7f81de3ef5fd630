"""The C++ CPU kernels' process-wide settings for a loaded model: whether few-row calls run on the
takeover pool (``csrc/takeover_pool.h``) and up to how many rows, whether the int4 products'
prefetch keeps the weights in the caches (``cpu_cache.py``), and from how many rows their tiles take two
panels in 512-bit vectors (``pair_tiles_from``).

They choose threads and cache hints, never a result. A runner applies its settings once, at load: a
worker process holds one runner. A process that holds runners of several formats (tests, benchmarks
comparing formats) calls ``ModelRunner.apply_kernel_settings()`` before timing or counting the pool
use of a runner that was not the last one loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from services.worker.cpu_cache import keep_weights_cached, l3_cache_bytes
from services.worker.cpu_kernels import cpu_kernels
from services.worker.linear import held_bytes, linears_of

# Two panels per 512-bit tile pay from this many rows where a core runs two 512-bit multiply-adds a cycle
# (the default model's steps of 6 / 8 / 12 rows 1.12x / 1.19x / 1.17x faster, 5 rows 1.04x, 2-4 rows slower;
# the MoE benchmark model's 8-token step 1.08x). Where 512-bit products come no faster than 256-bit ones
# (one 512-bit port, or Zen 4's halves in turn) they save only instructions: from PAIR_MIN_ROWS, as before.
PAIR_MIN_ROWS_TWO_PORTS, PAIR_MIN_ROWS = 5, 16
TWO_PORTS_RATE = 1.5  # 512-bit products at least this many times the 256-bit rate: two 512-bit ports


def pair_tiles_from(wide_rate: float) -> tuple[int, str]:
    """From how many rows calls take two panels per 512-bit tile (0: never), and why, given the measured rate of
    512-bit VNNI products over 256-bit ones (0: a build without VNNI)."""
    if wide_rate <= 0:
        return 0, "never: no AVX-512 VNNI in this build"
    ports = "two 512-bit ports" if wide_rate >= TWO_PORTS_RATE else "no faster than 256-bit ones"
    rows = PAIR_MIN_ROWS_TWO_PORTS if wide_rate >= TWO_PORTS_RATE else PAIR_MIN_ROWS
    return rows, f"from {rows} rows: 512-bit products {wide_rate:.2f}x the 256-bit rate ({ports})"


@cache
def _wide_product_rate() -> float:
    return cpu_kernels()[0].block_quant_wide_product_rate()  # measured once per process (~2 ms)


@dataclass(frozen=True)
class CpuKernelSettings:
    takeover_pool: bool
    pool_max_rows: int
    keep_weights_cached: bool
    weight_prefetch: str  # the prefetch's choice and why, for /instrumentation
    pair_min_rows: int
    pair_tiles: str  # the pair tiles' choice and why, for /instrumentation

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
        return cls(one_call, kernels.TAKEOVER_POOL_MAX_ROWS, keep, why, *pair_tiles_from(_wide_product_rate()))

    def apply(self) -> None:
        kernels = cpu_kernels()[0]
        kernels.set_takeover_pool(self.takeover_pool, self.pool_max_rows)
        kernels.set_weight_prefetch_keep(self.keep_weights_cached)
        kernels.set_block_quant_pair_min_rows(self.pair_min_rows)
