"""The C++ decode-attention kernel (the ``cpp`` backend, the CPU's default for fp32) against the torch
path: decodes in place through out-of-order block tables beside prefill chunks, GQA groups of 1-4,
contexts ending on, before and after block boundaries; queries read in place from the fused qkv rows;
refusal of a plan that points outside the cache, for reads and for the step's cache write; an int8 cache
(llama.cpp's q8_0 per head vector) written and read."""

from __future__ import annotations

import pytest
import torch

from services.worker.attention import paged_attention, paged_attention_cpp, q8_dequantize, select_attention_backend
from services.worker.cpu_kernels import cpu_kernels
from shared.model_info import q8_row_width

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


def test_a_decode_only_step_builds_what_the_cpp_backend_reads_and_no_more() -> None:
    """The cpp backend's decode-only metadata (its own short path): the torch path's positions, cache writes
    and longest position; each row's block table and context length; none of the other backends' tensors."""
    _, _, _, torch_meta = attention_step("decode-only-gqa4", torch.float32, backend="torch")
    _, _, _, meta = attention_step("decode-only-gqa4", torch.float32, backend="cpp")
    assert torch.equal(meta.positions, torch_meta.positions) and torch.equal(meta.write_slots, torch_meta.write_slots)
    assert (meta.max_position, meta.num_decodes, meta.block_size) == (torch_meta.max_position, 4, 4)
    assert torch.equal(meta.row_block_tables, torch_meta.block_tables) and meta.row_block_tables.dtype == torch.int32
    assert meta.row_context_lens.tolist() == [p + 1 for p in torch_meta.positions.tolist()]
    assert meta.decode_slots is None and meta.decode_mask is None and meta.query_starts is None and meta.prefills == ()


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


def reference_attention(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """Row by row in torch: gather the row's keys and values through its block table, then softmax(q k^T) v in fp64."""
    kv_heads, group = cache.shape[2], q.shape[1] // cache.shape[2]
    out = torch.empty_like(q)
    for row, n in enumerate(lens.tolist()):
        positions = torch.arange(n)
        slots = tables[row, positions // block_size].long() * block_size + positions % block_size
        keys, values = cache[slots, 0].double(), cache[slots, 1].double()  # [n, kv_heads, dim]
        query = q[row].double().view(kv_heads, group, -1)
        weights = torch.softmax(torch.einsum("hgd,nhd->hgn", query, keys) * scale, dim=-1)
        out[row] = torch.einsum("hgn,nhd->hgd", weights, values).reshape(q.shape[1], -1).float()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(9, 3, 64, 8), (3, 3, 64, 16), (8, 2, 128, 8), (6, 1, 96, 5), (16, 2, 32, 8), (2, 1, 40, 8)],
)
def test_the_kernel_matches_a_reference_over_long_and_ragged_contexts(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, block_size: int) -> None:
    """Every vector path (head_dim 32/64/96/128; GQA groups 1, 3, 4, 6, 8: head tiles of 3, 2 and 1) and
    the generic one (40), over contexts of one position, ends inside and on eight-position blocks, and
    lengths growing within one call (per-thread scratch grown mid-call); out-of-order block tables."""
    kernels, _ = cpu_kernels()
    generator = torch.Generator().manual_seed(heads * dim + block_size)
    lens = torch.tensor([1, 7, 8, 9, 17, 64, 150, 1031, 3, 600], dtype=torch.int32)
    width = -(-int(lens.max()) // block_size)
    blocks = torch.randperm(len(lens) * width, generator=generator).view(len(lens), width).to(torch.int32)
    cache = torch.randn(len(lens) * width * block_size, 2, kv_heads, dim, generator=generator).to(dtype)
    q = 2 * torch.randn(len(lens), heads, dim, generator=generator)
    scale = dim**-0.5
    ours = kernels.paged_decode_attention(q, cache, blocks, lens, block_size, scale)
    torch.testing.assert_close(ours, reference_attention(q, cache, blocks, lens, block_size, scale), rtol=1e-5, atol=1e-5)


def test_a_write_outside_the_cache_is_refused_before_anything_is_written() -> None:
    """``store_kv_`` (the cpp backend's cache write) checks every slot first; int32 slots work as int64
    do, and a kv whose rows are not contiguous is written as its contiguous copy would be."""
    kernels, _ = cpu_kernels()
    cache = torch.zeros(16, 2, 2, 32, dtype=torch.float16)
    kv = torch.randn(3, 2, 2, 32)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        kernels.store_kv_(cache, kv, torch.tensor([1, 16, 2]))
    assert not cache.any()
    kernels.store_kv_(cache, kv, torch.tensor([1, 15, 2], dtype=torch.int32))
    torch.testing.assert_close(cache[[1, 15, 2]], kv.half(), rtol=0, atol=0)
    scattered = torch.randn(3, 32, 2, 2).permute(0, 2, 3, 1)  # a token's values not contiguous: copied first
    kernels.store_kv_(cache, scattered, torch.tensor([4, 5, 6]))
    torch.testing.assert_close(cache[[4, 5, 6]], scattered.half(), rtol=0, atol=0)


def test_queries_are_read_in_place_from_the_fused_qkv_rows() -> None:
    """The model hands the kernel ``qkv[:, :heads]``, a view whose rows are further apart than its heads:
    the answer is the contiguous copy's, to the bit."""
    kernels, _ = cpu_kernels()
    cache = torch.randn(4 * 8, 2, 3, 64)
    qkv = torch.randn(5, 9 + 2 * 3, 64)
    tables, lens = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]], dtype=torch.int32), torch.tensor([9, 16, 3, 12, 1], dtype=torch.int32)
    view = qkv[:, :9]
    assert not view.is_contiguous()
    ours = kernels.paged_decode_attention(view, cache, tables, lens, 8, 0.125)
    torch.testing.assert_close(ours, kernels.paged_decode_attention(view.contiguous(), cache, tables, lens, 8, 0.125), rtol=0, atol=0)
    torch.testing.assert_close(ours, reference_attention(view.contiguous(), cache, tables, lens, 8, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_whole_row_items_answer_to_the_bit_as_one_row_at_a_time_does(dtype: torch.dtype) -> None:
    """With enough rows per thread a row is one work item: a decode row's context is copied out of its
    scattered blocks first, a context too long for L2 and the later rows of a prefill chunk are read in
    place. Each way gives the bits that a call of that row alone (kv-head items, in place) gives."""
    kernels, _ = cpu_kernels()
    generator = torch.Generator().manual_seed(7)
    block_size, width = 8, 90
    # Six decode rows, a prefill chunk of five rows (positions 36..40 of request 6), and a long row
    # (700 slots of 1.5 KB in fp32 are past the copy's L2 budget; in fp16 they are copied).
    lens = [5, 1, 64, 33, 120, 8, 37, 38, 39, 40, 41, 700]
    requests = [0, 1, 2, 3, 4, 5, 6, 6, 6, 6, 6, 7]
    assert len(lens) >= 4 * torch.get_num_threads()  # whole rows are the items
    tables = torch.randperm(8 * width, generator=generator).view(8, width).to(torch.int32)[requests].contiguous()
    cache = torch.randn(8 * width * block_size, 2, 3, 64, generator=generator).to(dtype)
    q = torch.randn(len(lens), 9, 64, generator=generator)
    context = torch.tensor(lens, dtype=torch.int32)
    together = kernels.paged_decode_attention(q, cache, tables, context, block_size, 0.125)
    for row in range(len(lens)):
        alone = kernels.paged_decode_attention(q[row : row + 1], cache, tables[row : row + 1], context[row : row + 1], block_size, 0.125)
        torch.testing.assert_close(together[row : row + 1], alone, rtol=0, atol=0)
    torch.testing.assert_close(together, reference_attention(q, cache, tables, context, block_size, 0.125), rtol=1e-5, atol=1e-5)


def test_an_int8_cache_holds_each_block_within_half_a_step() -> None:
    """``store_kv_`` into an int8 cache: per head vector, codes and then one fp16 scale per 32 elements (the
    block's largest magnitude / 127, rounded to fp16), each element the nearest multiple of its block's
    stored scale; a zero vector stays zero. A head_dim that is not a multiple of 32, or a row of the
    wrong width, is refused before anything is written."""
    kernels, _ = cpu_kernels()
    generator = torch.Generator().manual_seed(3)
    kv = torch.randn(5, 2, 3, 64, generator=generator) * torch.logspace(-3, 2, 5)[:, None, None, None]
    kv[2, 1, 0] = 0.0
    cache = torch.zeros(8, 2, 3, q8_row_width(64), dtype=torch.int8)
    kernels.store_kv_(cache, kv, torch.tensor([6, 0, 3, 7, 1]))
    stored = cache[[6, 0, 3, 7, 1]]
    blocks = kv.unflatten(-1, (2, 32))
    scales = (blocks.abs().amax(-1) / 127).half().float()
    torch.testing.assert_close(stored[..., 64:].contiguous().view(torch.float16).float(), scales, rtol=0, atol=0)
    error = (q8_dequantize(stored) - kv).unflatten(-1, (2, 32)).abs().amax(-1)
    assert bool((error <= scales / 2 * (1 + 1e-6)).all())
    assert not q8_dequantize(stored)[2, 1, 0].any()
    assert int(stored[..., :64].abs().amax()) == 127
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.store_kv_(torch.zeros(8, 2, 3, 40 + 2, dtype=torch.int8), torch.randn(1, 2, 3, 40), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="row shape"):
        kernels.store_kv_(torch.zeros(8, 2, 3, 64, dtype=torch.int8), torch.randn(1, 2, 3, 64), torch.tensor([0]))


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), [(9, 3, 64, 8), (8, 2, 128, 8), (16, 2, 32, 8), (6, 1, 96, 5)])
def test_an_int8_cache_is_read_as_its_dequantized_values_to_the_bit(heads: int, kv_heads: int, dim: int, block_size: int) -> None:
    """The kernel over an int8 cache gives the bits it gives over an fp32 cache holding the dequantized
    values (a code times an fp16 scale is exact in fp32): kv-head items (few rows) and whole rows (enough
    rows per thread: decode rows copied out of their blocks, a prefill chunk's later rows in place)."""
    kernels, _ = cpu_kernels()
    generator = torch.Generator().manual_seed(heads + dim)
    lens = [5, 1, 64, 33, 120, 8, 37, 38, 39, 40, 41, 300]
    requests = [0, 1, 2, 3, 4, 5, 6, 6, 6, 6, 6, 7]
    width = -(-max(lens) // block_size)
    tables = torch.randperm(8 * width, generator=generator).view(8, width).to(torch.int32)[requests].contiguous()
    slots = 8 * width * block_size
    cache = torch.zeros(slots, 2, kv_heads, q8_row_width(dim), dtype=torch.int8)
    kernels.store_kv_(cache, 3 * torch.randn(slots, 2, kv_heads, dim, generator=generator), torch.arange(slots))
    dequantized = q8_dequantize(cache)
    q = torch.randn(len(lens), heads, dim, generator=generator)
    context = torch.tensor(lens, dtype=torch.int32)
    for rows in (slice(0, 2), slice(0, len(lens))):
        ours = kernels.paged_decode_attention(q[rows], cache, tables[rows], context[rows], block_size, dim**-0.5)
        torch.testing.assert_close(
            ours, kernels.paged_decode_attention(q[rows], dequantized, tables[rows], context[rows], block_size, dim**-0.5), rtol=0, atol=0
        )
    torch.testing.assert_close(ours, reference_attention(q, dequantized, tables, context, block_size, dim**-0.5), rtol=1e-5, atol=1e-5)
