"""Whether the CPU worker's weight prefetch keeps the weights in the caches: the L3's size as Linux
reports it, the setting's choice, what the worker reports, and the same results either way; per CPU
class (its /proc/cpuinfo flags and sysfs caches fed as fixtures), the kernels' instructions and prefetch;
and from how many rows the products take two panels per 512-bit tile, by the core's measured rate."""

from __future__ import annotations

import pytest
import torch

from services.worker import block_quant
from services.worker.cpu_cache import keep_weights_cached, l3_cache_bytes
from services.worker.cpu_kernels import cpu_kernels, isa_flags
from services.worker.kernel_settings import PAIR_MIN_ROWS, PAIR_MIN_ROWS_TWO_PORTS, pair_tiles_from

kernels = pytest.mark.skipif(cpu_kernels()[0] is None, reason=f"CPU kernels unavailable: {cpu_kernels()[1]}")


def _cache_index(root, name: str, level: str, size: str) -> None:
    index = root / name
    index.mkdir()
    (index / "level").write_text(level + "\n")
    (index / "size").write_text(size + "\n")


def test_the_l3_size_is_read_off_sysfs_and_0_where_none_is_reported(tmp_path) -> None:
    _cache_index(tmp_path, "index0", "1", "48K")
    _cache_index(tmp_path, "index2", "2", "2048K")
    assert l3_cache_bytes(str(tmp_path)) == 0
    _cache_index(tmp_path, "index3", "3", "307200K")
    assert l3_cache_bytes(str(tmp_path)) == 300 << 20
    assert l3_cache_bytes(str(tmp_path / "absent")) == 0


def test_auto_keeps_weights_that_take_at_most_half_the_l3_and_the_setting_overrides() -> None:
    mb = 1 << 20
    assert keep_weights_cached("auto", 96 * mb, 300 * mb) == (True, "keep: 101 MB of quantized weights, an L3 of 315 MB")
    assert keep_weights_cached("auto", 96 * mb, 32 * mb)[0] is False  # streams from memory every step anyway
    assert keep_weights_cached("auto", 151 * mb, 300 * mb)[0] is False
    assert keep_weights_cached("auto", 1 * mb, 0)[0] is False  # no L3 reported: non-temporal
    assert keep_weights_cached("keep", 10_000 * mb, 32 * mb) == (True, "keep: asked for")
    assert keep_weights_cached("stream", 1 * mb, 300 * mb) == (False, "stream: asked for")


AVX2 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2"
AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl"
BUILD_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
BUILD_VNNI = [*BUILD_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
# Per class: its flags as /proc/cpuinfo lists them, its L3 as sysfs reports it, the build's flags, the default model's prefetch.
CPU_CLASSES = {
    "EPYC Zen 1 (AVX2 only, 8 MB L3)": (AVX2, "8192K", BUILD_AVX2, "stream"),
    "EPYC Zen 4 (AVX-512 VNNI, 32 MB L3)": (f"{AVX2} {AVX512} avx512_vnni avx512_bf16", "32768K", BUILD_VNNI, "stream"),
    "Xeon Sapphire Rapids (AVX-512 VNNI, AMX, 300 MB L3)": (f"{AVX2} {AVX512} avx512_vnni amx_int8", "307200K", BUILD_VNNI, "keep"),
    "Xeon Skylake-SP (AVX-512 without VNNI, 32 MB L3)": (f"{AVX2} {AVX512}", "33792K", BUILD_AVX2, "stream"),
    "no FMA (portable loops)": ("fpu sse sse2 avx avx2 f16c", "4096K", [], "stream"),
}
DEFAULT_MODEL_PANELS = 101 << 20  # the default model's quantized weights in panels


@pytest.mark.parametrize("cpu", list(CPU_CLASSES))
def test_each_cpu_class_gets_the_kernels_and_prefetch_its_cpuinfo_and_caches_call_for(cpu: str, tmp_path) -> None:
    """A tuning for one class cannot silently reach another: the build's instructions follow the listed flags only
    (VNNI only where avx512_vnni is listed with the AVX-512 it runs on), the prefetch the L3 sysfs reports."""
    flags, l3, compile_flags, prefetch = CPU_CLASSES[cpu]
    (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nmodel name\t: {cpu}\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    _cache_index(tmp_path, "index0", "1", "48K")
    _cache_index(tmp_path, "index3", "3", l3)
    assert isa_flags(str(tmp_path / "cpuinfo")) == compile_flags
    assert keep_weights_cached("auto", DEFAULT_MODEL_PANELS, l3_cache_bytes(str(tmp_path)))[1].startswith(prefetch)


@kernels
@pytest.mark.parametrize("rows", [1, 33])  # one-row tiles, and two panels per tile
def test_the_prefetch_hint_changes_no_bit_of_the_products(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    w, x = torch.randn(300, 256, generator=generator), torch.randn(rows, 256, generator=generator)
    panels = block_quant.to_panels(block_quant.quantize(w, "q4_1"))
    k = cpu_kernels()[0]
    before = k.weight_prefetch_keep()
    try:
        results = []
        for keep in (True, False):
            k.set_weight_prefetch_keep(keep)
            assert k.weight_prefetch_keep() is keep
            results.append(k.block_quant_gemm(x, panels, 300, None, None, 16))
    finally:
        k.set_weight_prefetch_keep(before)
    assert torch.equal(*results)


def test_pair_tiles_start_early_only_where_the_core_runs_two_512_bit_products_a_cycle() -> None:
    assert pair_tiles_from(0.0) == (0, "never: no AVX-512 VNNI in this build")
    assert pair_tiles_from(1.02) == (PAIR_MIN_ROWS, f"from {PAIR_MIN_ROWS} rows: 512-bit products 1.02x the 256-bit rate (no faster than 256-bit ones)")
    assert pair_tiles_from(1.49)[0] == PAIR_MIN_ROWS  # a Zen 4 or one-port Xeon: 512-bit halves in turn
    assert pair_tiles_from(1.5)[0] == pair_tiles_from(1.93)[0] == PAIR_MIN_ROWS_TWO_PORTS
    assert PAIR_MIN_ROWS_TWO_PORTS < PAIR_MIN_ROWS


@kernels
def test_the_measured_512_bit_rate_is_a_rate_where_vnni_is_built_and_0_elsewhere() -> None:
    rate = cpu_kernels()[0].block_quant_wide_product_rate()
    if cpu_kernels()[0].block_quant_gemm_isa() == "avx512-vnni":
        assert 0.5 < rate < 4  # the same products per cycle (one port) up to twice as many (two), with the machine's noise
    else:
        assert rate == 0
