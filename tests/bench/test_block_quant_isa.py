"""bench.block_quant_isa: the per-process measurement of the int4 block products' instruction variants."""

from __future__ import annotations

import argparse

import pytest

from bench.block_quant_isa import VNNI_VARIANTS, measure
from services.worker.cpu_kernels import cpu_kernels
from tests.worker.harness import build_tiny


@pytest.mark.skipif(cpu_kernels()[0] is None, reason=f"CPU kernels unavailable: {cpu_kernels()[1]}")
def test_the_isa_bench_times_each_variant_of_this_build(tmp_path) -> None:
    """A decode step time per batch for each variant the build runs (avx2 alone, or both VNNI variants)."""
    build_tiny("llama", str(tmp_path / "tiny"))
    args = argparse.Namespace(model=str(tmp_path / "tiny"), batches=[1, 2], context=6, steps=2)
    results = measure(args)
    expected = {"avx2"} if cpu_kernels()[0].block_quant_gemm_isa() == "avx2" else set(VNNI_VARIANTS)
    assert set(results) == expected
    assert all(set(per) == {1, 2} and all(s > 0 for s in per.values()) for per in results.values())
