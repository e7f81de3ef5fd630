"""The Triton GDN kernels (chunked gated delta rule, fused recurrent step, causal conv1d) on the CPU under
``TRITON_INTERPRET=1`` against a token-by-token torch reference written here in float64: packed sequences of
length 1, not a multiple of 64 and longer than one chunk (and an empty one); v-heads sharing q/k heads; head sizes that are not
powers of two and span several tiles; initial states read from slots given out of order; a sequence that
ignores the (non-zero) state of its slot; and slots nobody names left untouched. Then prefill split at an
arbitrary point plus decode steps equals one pass. Where the torch forms (``services.worker.gdn``) exist,
the kernels must agree with them too.

Tolerances: fp32 kernels against the float64 reference, relative Frobenius error ≤ 1e-5 (fp32 rounding,
2⁻²⁴ ≈ 6e-8, grown over tens of steps and 64-term sums: measured ~3e-7). fp16 inputs are given to the
reference as the same fp16 values, so what remains is the kernels' fp16 intermediates (W, U, δ and the
per-chunk state are held in the input dtype, as on the GPU) and the output's rounding (2e-4 alone): measured
~4e-4, bound 2e-3. The conv state is a copy of inputs and old state: equal exactly.

The kernels run in one child process started with TRITON_INTERPRET=1 (see test_fused_moe.py for why). A
child works on copies, so the helpers below return the state pools that the kernels updated in place.
"""

from __future__ import annotations

from multiprocessing.pool import Pool

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from services.worker.kernels import conv1d, gdn  # noqa: E402  (run in the child, interpreted)

Tensor = torch.Tensor


# What the child runs: the kernels, returning the pools they updated in place. ---------------------------


def _prefill(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor, slots: Tensor, cu: Tensor, initial: Tensor) -> tuple[Tensor, Tensor]:
    o = gdn.chunk_gated_delta_rule(q, k, v, g, beta, q.shape[-1] ** -0.5, pool, slots, cu, initial)
    return o, pool


def _decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    return gdn.fused_recurrent_gated_delta_rule(q, k, v, g, beta, q.shape[-1] ** -0.5, pool, slots), pool


def _split_prefill_then_decode(inputs: dict[str, Tensor], split: int, decode_steps: int, pool: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """One sequence (slot ``slots[0]``, no initial state): prefill [0, split), then [split, n − steps), then
    decode its last ``decode_steps`` tokens one at a time; the outputs in token order and the final pool."""
    n = inputs["v"].shape[0]
    cuts = [0, split, n - decode_steps]
    outs = []
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        part = {name: t[lo:hi] for name, t in inputs.items()}
        cu = torch.tensor([0, hi - lo], dtype=torch.int32)
        outs.append(_prefill(**part, pool=pool, slots=slots, cu=cu, initial=torch.tensor([i > 0]))[0])
    for t in range(n - decode_steps, n):
        outs.append(_decode(**{name: x[t : t + 1] for name, x in inputs.items()}, pool=pool, slots=slots)[0])
    return torch.cat(outs), pool


def _conv_prefill(x: Tensor, cu: Tensor, pool: Tensor, slots: Tensor, initial: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    return conv1d.causal_conv1d_varlen(x, cu, pool, slots, initial, weight, bias), pool


def _conv_decode(x: Tensor, pool: Tensor, slots: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    return conv1d.causal_conv1d_update(x, pool, slots, weight, bias), pool


# References, token by token in float64. -----------------------------------------------------------------


def reference_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor, slots: Tensor, cu: Tensor, initial: Tensor
) -> tuple[Tensor, Tensor]:
    """S = S·e^g; δ = β(v − kᵀS); S += k δᵀ; o = (scale·q)ᵀS, for every head of every sequence (float64)."""
    q, k, v, g, beta, pool = (t.double() for t in (q, k, v, g, beta, pool))
    group = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(group, 1) * q.shape[-1] ** -0.5, k.repeat_interleave(group, 1)
    o = torch.empty_like(v)
    for b, slot in enumerate(slots.tolist()):
        state = pool[slot].clone() if initial[b] else torch.zeros_like(pool[slot])  # [Hv, Dk, Dv]
        for t in range(int(cu[b]), int(cu[b + 1])):
            state *= g[t].exp()[:, None, None]
            delta = beta[t, :, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], state))
            state += k[t, :, :, None] * delta[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", q[t], state)
        pool[slot] = state
    return o, pool


def reference_conv(x: Tensor, cu: Tensor, pool: Tensor, slots: Tensor, initial: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """y[t] = silu(b + Σ_j w[:, j]·x[t − K + 1 + j]) over [slot state (oldest first), the sequence]; float64."""
    x, pool, weight = x.double(), pool.double(), weight.double()
    width = weight.shape[1]
    y = torch.empty_like(x)
    for b, slot in enumerate(slots.tolist()):
        history = pool[slot] if initial[b] else torch.zeros_like(pool[slot])
        seq = torch.cat([history, x[int(cu[b]) : int(cu[b + 1])].T], 1)  # [C, K − 1 + L]
        for i in range(seq.shape[1] - width + 1):
            y[int(cu[b]) + i] = F.silu((seq[:, i : i + width] * weight).sum(1) + (0 if bias is None else bias.double()))
        pool[slot] = seq[:, -(width - 1) :]
    return y, pool


# Inputs. --------------------------------------------------------------------------------------------------

HK, HV, DK, DV = 2, 4, 72, 40  # Hv > Hk; head sizes that are not powers of two and span two tiles (Dk: 64-wide, Dv: 32-wide in the state kernels)
LENGTHS = [70, 1, 0]  # longer than a chunk and not a multiple of 64; a single token; none (its slot is reset)
SLOTS = [5, 0, 3]  # out of order; slots 1, 2, 4 and 6 are nobody's
INITIAL = [False, True, False]  # slot 5 holds a stale state the first sequence must not read (the split test below starts a long one from a slot)
NUM_SLOTS = 7


def delta_rule_inputs(num_tokens: int, dtype: torch.dtype, seed: int) -> dict[str, Tensor]:
    """q, k L2-normalised (as the layer gives them); g = log-decay ≤ 0; β ∈ (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": F.normalize(torch.randn(num_tokens, HK, DK, generator=gen), dim=-1).to(dtype),
        "k": F.normalize(torch.randn(num_tokens, HK, DK, generator=gen), dim=-1).to(dtype),
        "v": torch.randn(num_tokens, HV, DV, generator=gen).to(dtype),
        "g": -0.3 * torch.rand(num_tokens, HV, generator=gen),
        "beta": torch.rand(num_tokens, HV, generator=gen),
    }


def state_pool(seed: int) -> Tensor:
    return 0.5 * torch.randn(NUM_SLOTS, HV, DK, DV, generator=torch.Generator().manual_seed(seed))


def cu_seqlens(lengths: list[int]) -> Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def relative_error(ours: Tensor, expected: Tensor) -> float:
    return ((ours.double() - expected.double()).norm() / expected.double().norm()).item()


def assert_untouched(pool: Tensor, before: Tensor, used: list[int]) -> None:
    others = [s for s in range(pool.shape[0]) if s not in used]
    assert torch.equal(pool[others], before[others])


PRECISIONS = pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"])


# Tests. ---------------------------------------------------------------------------------------------------


@PRECISIONS
def test_chunked_prefill_matches_the_token_by_token_recurrence(interpreter: Pool, dtype: torch.dtype, tolerance: float) -> None:
    inputs = delta_rule_inputs(sum(LENGTHS), dtype, seed=1)
    pool, slots, cu, initial = state_pool(2), torch.tensor(SLOTS, dtype=torch.int32), cu_seqlens(LENGTHS), torch.tensor(INITIAL)
    o, new_pool = interpreter.apply(_prefill, (*inputs.values(), pool.clone(), slots, cu, initial))
    expected_o, expected_pool = reference_delta_rule(*inputs.values(), pool, slots, cu, initial)
    assert o.dtype == dtype and o.shape == expected_o.shape
    assert relative_error(o, expected_o) < tolerance
    for slot, length in zip(SLOTS, LENGTHS):  # per slot: a wrong slot or a missed initial state shows even where other slots are right
        if length:
            assert relative_error(new_pool[slot], expected_pool[slot]) < tolerance
        else:
            assert not new_pool[slot].any()  # nothing read, nothing added
    assert_untouched(new_pool, pool, SLOTS)


@PRECISIONS
def test_fused_recurrent_step_updates_its_slots_in_place(interpreter: Pool, dtype: torch.dtype, tolerance: float) -> None:
    slots = torch.tensor([4, 1, 6], dtype=torch.int32)
    pool = expected_pool = state_pool(3)
    ours = pool.clone()
    one_token = cu_seqlens([1] * len(slots))
    for step in range(2):
        inputs = delta_rule_inputs(len(slots), dtype, seed=10 + step)
        o, ours = interpreter.apply(_decode, (*inputs.values(), ours, slots))
        expected_o, expected_pool = reference_delta_rule(*inputs.values(), expected_pool, slots, one_token, torch.ones(len(slots), dtype=torch.bool))
        assert o.dtype == dtype and relative_error(o, expected_o) < tolerance
    for slot in slots.tolist():
        assert relative_error(ours[slot], expected_pool[slot]) < tolerance
    assert_untouched(ours, pool, slots.tolist())


def test_prefill_in_pieces_then_decode_equals_one_pass(interpreter: Pool) -> None:
    """The state a chunk leaves in its slot is the one the next chunk (at a non-multiple-of-64 split) and the
    decode steps start from."""
    inputs = delta_rule_inputs(75, torch.float32, seed=4)
    slots = torch.tensor([2], dtype=torch.int32)
    pool = state_pool(5)
    o, new_pool = interpreter.apply(_split_prefill_then_decode, (inputs, 37, 3, pool.clone(), slots))
    expected_o, expected_pool = reference_delta_rule(*inputs.values(), pool, slots, cu_seqlens([75]), torch.tensor([False]))
    assert relative_error(o, expected_o) < 1e-5
    assert relative_error(new_pool[2], expected_pool[2]) < 1e-5
    assert_untouched(new_pool, pool, [2])


def test_chunked_prefill_stays_accurate_when_keys_nearly_repeat(interpreter: Pool) -> None:
    """Nearly parallel keys with β ≈ 1 and almost no decay make A's entries ≈ 1, where a careless inverse of
    I + A (a power series over all 64 rows, whose terms grow like binomial coefficients and cancel) loses every
    digit; two full chunks, fp32."""
    gen = torch.Generator().manual_seed(11)
    n, dim = 128, 32
    k = F.normalize(torch.randn(dim, generator=gen) + 0.05 * torch.randn(n, 1, dim, generator=gen), dim=-1)
    q = F.normalize(torch.randn(n, 1, dim, generator=gen), dim=-1)
    v, g, beta = torch.randn(n, 1, dim, generator=gen), torch.full((n, 1), -1e-3), torch.full((n, 1), 0.99)
    pool, slots, cu, initial = torch.zeros(1, 1, dim, dim), torch.tensor([0], dtype=torch.int32), cu_seqlens([n]), torch.tensor([False])
    o, new_pool = interpreter.apply(_prefill, (q, k, v, g, beta, pool.clone(), slots, cu, initial))
    expected_o, expected_pool = reference_delta_rule(q, k, v, g, beta, pool, slots, cu, initial)
    assert relative_error(o, expected_o) < 1e-5 and relative_error(new_pool, expected_pool) < 1e-5  # measured ~1.5e-6


CONV_CHANNELS, CONV_WIDTH = 40, 4  # channels not a power of two; the GDN layers' kernel width
CONV_LENGTHS = [1, 2, 9, 0, 20]  # shorter than K − 1 (the slot keeps older state), empty, several token tiles
CONV_SLOTS = [3, 6, 0, 5, 1]
CONV_INITIAL = [True, True, False, True, True]


@PRECISIONS
def test_causal_conv1d_prefill_and_update_match_the_reference(interpreter: Pool, dtype: torch.dtype, tolerance: float) -> None:
    gen = torch.Generator().manual_seed(6)
    c, width = CONV_CHANNELS, CONV_WIDTH
    cu, slots, initial = cu_seqlens(CONV_LENGTHS), torch.tensor(CONV_SLOTS, dtype=torch.int32), torch.tensor(CONV_INITIAL)
    x = torch.randn(int(cu[-1]), c, generator=gen).to(dtype)
    weight, bias = (torch.randn(c, width, generator=gen) / 2).to(dtype), torch.randn(c, generator=gen).to(dtype)
    pool = torch.randn(8, c, width - 1, generator=gen).to(dtype)

    y, ours = interpreter.apply(_conv_prefill, (x, cu, pool.clone(), slots, initial, weight, bias))
    expected_y, expected_pool = reference_conv(x, cu, pool, slots, initial, weight, bias)
    assert y.dtype == dtype and relative_error(y, expected_y) < tolerance
    assert torch.equal(ours[CONV_SLOTS], expected_pool[CONV_SLOTS].to(dtype))
    assert_untouched(ours, pool, CONV_SLOTS)

    x_step = torch.randn(len(CONV_SLOTS), c, generator=gen).to(dtype)
    y, ours = interpreter.apply(_conv_decode, (x_step, ours, slots, weight, None))
    expected_y, expected_pool = reference_conv(x_step, cu_seqlens([1] * len(CONV_SLOTS)), expected_pool, slots, torch.ones(5, dtype=torch.bool), weight, None)
    assert relative_error(y, expected_y) < tolerance
    assert torch.equal(ours[CONV_SLOTS], expected_pool[CONV_SLOTS].to(dtype))
    assert_untouched(ours, pool, CONV_SLOTS)


def test_kernels_agree_with_the_torch_forms(interpreter: Pool) -> None:
    """The model's CPU path and its GPU path on the same batch (fp32)."""
    torch_forms = pytest.importorskip("services.worker.gdn")
    inputs = delta_rule_inputs(sum(LENGTHS), torch.float32, seed=7)
    pool, slots, cu, initial = state_pool(8), torch.tensor(SLOTS, dtype=torch.int32), cu_seqlens(LENGTHS), torch.tensor(INITIAL)
    o, ours = interpreter.apply(_prefill, (*inputs.values(), pool.clone(), slots, cu, initial))
    theirs = pool.clone()
    expected_o = torch_forms.chunk_gated_delta_rule(*inputs.values(), DK**-0.5, theirs, slots, cu, initial)
    assert relative_error(o, expected_o) < 1e-5 and relative_error(ours, theirs) < 1e-5

    step = delta_rule_inputs(len(SLOTS), torch.float32, seed=9)
    o, ours = interpreter.apply(_decode, (*step.values(), ours, slots))
    expected_o = torch_forms.fused_recurrent_gated_delta_rule(*step.values(), DK**-0.5, theirs, slots)
    assert relative_error(o, expected_o) < 1e-5 and relative_error(ours, theirs) < 1e-5

    gen = torch.Generator().manual_seed(10)
    x, weight, bias = torch.randn(int(cu[-1]), 24, generator=gen), torch.randn(24, 4, generator=gen), torch.randn(24, generator=gen)
    conv_pool = torch.randn(NUM_SLOTS, 24, 3, generator=gen)
    y, ours = interpreter.apply(_conv_prefill, (x, cu, conv_pool.clone(), slots, initial, weight, bias))
    theirs = conv_pool.clone()
    expected_y = torch_forms.causal_conv1d_varlen(x, cu, theirs, slots, initial, weight, bias)
    assert relative_error(y, expected_y) < 1e-5 and torch.equal(ours, theirs)
    x_step = torch.randn(len(SLOTS), 24, generator=gen)
    y, ours = interpreter.apply(_conv_decode, (x_step, ours, slots, weight, bias))
    assert relative_error(y, torch_forms.causal_conv1d_update(x_step, theirs, slots, weight, bias)) < 1e-5 and torch.equal(ours, theirs)
