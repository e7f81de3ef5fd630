"""Whether the CPU worker's weight prefetch keeps the weights in the caches: the L3's size as Linux
reports it, the setting's choice, what the worker reports, and the same results either way."""

from __future__ import annotations

import pytest
import torch

from services.worker import block_quant
from services.worker.cpu_cache import keep_weights_cached, l3_cache_bytes
from services.worker.cpu_kernels import cpu_kernels

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
