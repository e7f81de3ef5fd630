"""The C++ decode-attention kernel (the ``cpp`` backend, the CPU's default for fp32) against the torch
path: decodes in place through out-of-order block tables beside prefill chunks, GQA groups of 1-4,
contexts ending on, before and after block boundaries; refusal of a plan that points outside the cache."""

from __future__ import annotations

import pytest
import torch

from services.worker.attention import paged_attention, paged_attention_cpp, select_attention_backend
from services.worker.cpu_kernels import cpu_kernels

from .harness import ATTENTION_CASES, attention_step


def test_the_kernels_build_on_this_machine() -> None:
    """CI has a compiler: a silent fallback to the torch path must not pass for the kernel working."""
    kernels, why = cpu_kernels()
    assert kernels is not None, why
    assert select_attention_backend(torch.device("cpu"), torch.float32) == "cpp"
    assert select_attention_backend(torch.device("cpu"), torch.bfloat16) == "torch"


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_cpp_backend_matches_the_torch_path(case: str) -> None:
    q, kv, cache, meta = attention_step(case, torch.float32, backend="torch")
    _, _, _, cpp_meta = attention_step(case, torch.float32, backend="cpp")
    cache_cpp = cache.clone()
    expected = paged_attention(q, kv, cache, meta)
    ours = paged_attention_cpp(q, kv, cache_cpp, cpp_meta)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache_cpp, cache, rtol=0, atol=0)  # this step's keys stored alike


@pytest.mark.parametrize("case", ["decode-only-gqa4", "mixed-gqa3-cached-prefix", "smollm2-shaped-decodes"])
def test_an_fp16_cache_is_read_as_the_torch_path_reads_it(case: str) -> None:
    """fp16 storage: both backends round this step's keys alike and attend over the same fp16 values
    in fp32; and the result stays within fp16's rounding of the fp32 cache's."""
    q, kv, cache, meta = attention_step(case, torch.float32, backend="torch")
    _, _, _, cpp_meta = attention_step(case, torch.float32, backend="cpp")
    half, half_cpp = cache.half(), cache.half()
    expected = paged_attention(q, kv, half, meta)
    ours = paged_attention_cpp(q, kv, half_cpp, cpp_meta)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(half_cpp, half, rtol=0, atol=0)
    exact = paged_attention(q, kv, cache, meta)
    assert 0 < (ours - exact).abs().max() < 5e-3


def test_a_block_outside_the_cache_is_refused_not_read() -> None:
    kernels, _ = cpu_kernels()
    cache = torch.zeros(4 * 16, 2, 1, 8)
    q = torch.ones(1, 2, 8)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        kernels.paged_decode_attention(q, cache, torch.tensor([[7]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 16, 1.0)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        kernels.paged_decode_attention(q, cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([17], dtype=torch.int32), 16, 1.0)
