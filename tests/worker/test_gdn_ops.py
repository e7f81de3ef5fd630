"""The torch GDN ops against a direct token-by-token reference: the chunked and the recurrent delta rule
and the conv1d, over variable-length batches that start from states in their slots and leave them there."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.gdn import (
    CHUNK,
    causal_conv1d_update,
    causal_conv1d_varlen,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)

HK, HV, DK, DV, SLOTS = 2, 4, 16, 8, 6


def naive_delta_rule(q, k, v, g, beta, scale, state):
    """Token by token, one sequence: q, k [L, Hk, Dk]; v [L, Hv, Dv]; state [Hv, Dk, Dv] → (o [L, Hv, Dv], final state)."""
    group = v.shape[1] // q.shape[1]
    state = state.clone()
    out = torch.empty(v.shape)
    for t in range(v.shape[0]):
        for h in range(v.shape[1]):
            qt, kt = q[t, h // group] * scale, k[t, h // group]
            state[h] *= g[t, h].exp()
            delta = beta[t, h] * (v[t, h] - kt @ state[h])
            state[h] += torch.outer(kt, delta)
            out[t, h] = qt @ state[h]
    return out, state


def inputs(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(num_tokens, HK, DK, generator=gen), dim=-1)
    k = F.normalize(torch.randn(num_tokens, HK, DK, generator=gen), dim=-1)
    v = torch.randn(num_tokens, HV, DV, generator=gen)
    g = -F.softplus(torch.randn(num_tokens, HV, generator=gen))  # log-decay <= 0, some near 0
    beta = torch.rand(num_tokens, HV, generator=gen)
    return q, k, v, g, beta


def test_chunked_form_matches_token_by_token_on_a_varlen_batch_with_initial_states() -> None:
    lens = [1, CHUNK, 150, 37]  # one token, exactly a chunk, several chunks and a partial one, less than a chunk
    slots = torch.tensor([4, 0, 5, 2])
    has_initial = torch.tensor([True, False, True, True])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, g, beta = inputs(sum(lens), seed=0)
    pool = torch.randn(SLOTS, HV, DK, DV, generator=torch.Generator().manual_seed(1))
    before = pool.clone()
    out = chunk_gated_delta_rule(q, k, v, g, beta, DK**-0.5, pool, slots, cu, has_initial)
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        initial = before[slots[b]] if has_initial[b] else torch.zeros(HV, DK, DV)
        expected, final = naive_delta_rule(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], DK**-0.5, initial)
        torch.testing.assert_close(out[start:end], expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool[slots[b]], final, rtol=1e-4, atol=1e-5)
    untouched = [s for s in range(SLOTS) if s not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_recurrent_steps_continue_a_chunked_prefill_exactly_like_the_reference() -> None:
    """Prefill two sequences in two uneven chunks, then decode both for a few steps; the slots carry the state."""
    lens, steps = [70, 23], 5
    q, k, v, g, beta = inputs(sum(lens) + 2 * steps, seed=2)
    rows = [list(range(0, 70)), list(range(70, 93))]
    for i in range(steps):
        rows[0].append(93 + 2 * i)
        rows[1].append(94 + 2 * i)
    pool = torch.zeros(SLOTS, HV, DK, DV)
    slots = torch.tensor([3, 1])
    for first, (cut_a, cut_b) in enumerate([(0, 0), (41, 10)]):
        ends = (70, 23) if first else (41, 10)
        pieces = [rows[0][cut_a : ends[0]], rows[1][cut_b : ends[1]]]
        idx = torch.tensor(pieces[0] + pieces[1])
        cu = torch.tensor([0, len(pieces[0]), len(pieces[0]) + len(pieces[1])])
        chunk_gated_delta_rule(q[idx], k[idx], v[idx], g[idx], beta[idx], DK**-0.5, pool, slots, cu, torch.tensor([bool(first)] * 2))
    outs = []
    for i in range(steps):
        idx = torch.tensor([93 + 2 * i, 94 + 2 * i])
        outs.append(fused_recurrent_gated_delta_rule(q[idx], k[idx], v[idx], g[idx], beta[idx], DK**-0.5, pool, slots))
    for b in range(2):
        idx = torch.tensor(rows[b])
        expected, final = naive_delta_rule(q[idx], k[idx], v[idx], g[idx], beta[idx], DK**-0.5, torch.zeros(HV, DK, DV))
        torch.testing.assert_close(torch.stack([o[b] for o in outs]), expected[-steps:], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool[slots[b]], final, rtol=1e-4, atol=1e-5)


def test_recurrent_form_matches_the_chunked_form_one_token_at_a_time() -> None:
    q, k, v, g, beta = inputs(3, seed=3)
    initial = torch.randn(SLOTS, HV, DK, DV)
    chunked, recurrent = initial.clone(), initial.clone()
    slots = torch.tensor([5, 0, 2])
    out_chunked = chunk_gated_delta_rule(q, k, v, g, beta, 0.3, chunked, slots, torch.tensor([0, 1, 2, 3]), torch.tensor([True, True, True]))
    out_recurrent = fused_recurrent_gated_delta_rule(q, k, v, g, beta, 0.3, recurrent, slots)
    torch.testing.assert_close(out_recurrent, out_chunked, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(recurrent, chunked, rtol=1e-5, atol=1e-6)


def naive_conv(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence x [L, C] after ``history`` [C, K-1] → (silu(conv) [L, C], the last K-1 inputs [C, K-1])."""
    seen = torch.cat([history.t(), x])  # [K-1+L, C]
    width = weight.shape[1]
    out = torch.stack([(seen[t : t + width].t() * weight).sum(-1) for t in range(x.shape[0])])
    if bias is not None:
        out = out + bias
    return F.silu(out), seen[-(width - 1) :].t()


def test_conv1d_varlen_and_update_match_a_direct_convolution_carried_across_chunks() -> None:
    channels, width = 12, 4
    gen = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(channels, width, generator=gen), torch.randn(channels, generator=gen)
    lens = [2, 9, 1]  # shorter than the window, longer, a single token
    x = torch.randn(sum(lens), channels, generator=gen)
    pool = torch.randn(SLOTS, channels, width - 1, generator=gen)
    before = pool.clone()
    slots, has_initial = torch.tensor([1, 4, 3]), torch.tensor([True, False, True])
    cu = torch.tensor([0, 2, 11, 12])
    out = causal_conv1d_varlen(x, cu, pool, slots, has_initial, weight, bias)
    for b in range(3):
        start, end = cu[b].item(), cu[b + 1].item()
        history = before[slots[b]] if has_initial[b] else torch.zeros(channels, width - 1)
        expected, last = naive_conv(x[start:end], history, weight, bias)
        torch.testing.assert_close(out[start:end], expected)
        torch.testing.assert_close(pool[slots[b]], last)
    # Decode: one more input per sequence slides each window by one.
    step = torch.randn(3, channels, generator=gen)
    after_prefill = pool.clone()
    out = causal_conv1d_update(step, pool, slots, weight, None)
    for b in range(3):
        expected, last = naive_conv(step[b : b + 1], after_prefill[slots[b]], weight, None)
        torch.testing.assert_close(out[b], expected[0])
        torch.testing.assert_close(pool[slots[b]], last)
