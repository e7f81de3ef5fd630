"""Batched token sampling: logit bias and penalties, then per-row temperature (0 = greedy argmax),
top-k, top-p, min-p and seed, and the logprobs a request asks for.

Each row's result depends only on its own logits, history and generator, never on the other
rows, so a seeded request draws the same tokens whatever batch it shares. A draw takes one uniform
``u`` in [0, 1) from the row's generator and answers, in vocabulary order, the first kept token whose
running probability exceeds ``u`` (the inverse of the distribution's CDF: exactly a sample of it). On
the CPU the compiled ``sample_rows`` kernel does the whole of it for every row, with no sort and
~0.1 ms a row; the torch path here is its reference and its fallback.

Logprobs are "processed" ones: the log-softmax of the logits after ``logit_bias`` and the
penalties, before temperature and the top-k / top-p / min-p filters (so they are finite and
the same whatever the temperature, and a penalised token's logprob shows its penalty).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from services.worker.cpu_kernels import cpu_kernels
from shared.frames import SamplingParams, TokenLogprobs


class TokenHistory:
    """One request's tokens as the penalties see them, sparse: its distinct output tokens with how many
    times each was drawn and, for the repetition penalty, the distinct tokens seen in its prompt or
    output. Applying the penalties then costs O(distinct tokens), not O(vocabulary) (a dense
    [rows, vocabulary] pass took ~1 ms a row); an update costs O(tokens)."""

    def __init__(self, params: SamplingParams) -> None:
        self.output_ids: list[int] = []  # distinct, in the order first drawn
        self.output_counts: list[int] = []  # how many times each of output_ids was drawn
        self._position: dict[int, int] = {}  # token -> its index in output_ids
        # Prompt or output tokens, distinct: only for the repetition penalty.
        self.seen: list[int] | None = [] if params.repetition_penalty != 1 else None
        self._seen: set[int] = set()

    def add_prompt(self, token_ids: Sequence[int]) -> None:
        if self.seen is not None:
            self._see(token_ids)

    def add_outputs(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            at = self._position.get(token)
            if at is None:
                self._position[token] = len(self.output_ids)
                self.output_ids.append(token)
                self.output_counts.append(1)
            else:
                self.output_counts[at] += 1
        if self.seen is not None:
            self._see(token_ids)

    def _see(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            if token not in self._seen:
                self._seen.add(token)
                self.seen.append(token)  # type: ignore[union-attr]


class LogitBias(NamedTuple):
    """A request's ``logit_bias`` as two tensors, built once: token ids and the biases added to them."""

    ids: torch.Tensor
    values: torch.Tensor

    @classmethod
    def of(cls, bias: dict[int, float]) -> LogitBias | None:
        if not bias:
            return None
        return cls(torch.tensor(list(bias), dtype=torch.long), torch.tensor(list(bias.values()), dtype=torch.float32))


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None] | None = None,
    biases: Sequence[LogitBias | None] | None = None,
) -> torch.Tensor:
    """``logits`` [N, V] as float32 with each row's logit bias added, then its penalties applied (vLLM's order and math).

    May work in place on a float32 ``logits``.
    """
    logits = logits.float().contiguous()
    if biases is not None and any(b is not None for b in biases):
        bias_rows = [i for i, b in enumerate(biases) if b is not None]
        rows = torch.cat([torch.full((len(biases[i].ids),), i, dtype=torch.long) for i in bias_rows])  # type: ignore[union-attr]
        cols = torch.cat([biases[i].ids for i in bias_rows])  # type: ignore[union-attr]
        logits.index_put_((rows, cols), torch.cat([biases[i].values for i in bias_rows]), accumulate=True)  # type: ignore[union-attr]
    if histories is not None and any(h is not None for h in histories):
        _apply_penalties(logits, params, histories)
    return logits


def _apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory | None]) -> None:
    """repetition: a seen token's positive logit is divided by it, a negative one multiplied (prompt and output tokens);
    frequency: minus penalty x the token's output count; presence: minus penalty once the token was output.
    Only the entries of each row's distinct tokens are read and written (``logits`` contiguous [N, V])."""
    vocab, flat = logits.shape[-1], logits.view(-1)

    def entries(row: int, token_ids: list[int]) -> torch.Tensor:
        return torch.tensor(token_ids, device=logits.device) + row * vocab

    for row, (p, history) in enumerate(zip(params, histories)):
        if history is None:
            continue
        if history.seen:
            at = entries(row, history.seen)
            values = flat.index_select(0, at)
            flat.index_copy_(0, at, torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty))
        if (p.frequency_penalty or p.presence_penalty) and history.output_ids:
            at = entries(row, history.output_ids)
            counts = torch.tensor(history.output_counts, dtype=torch.float32, device=logits.device)
            flat.index_copy_(0, at, flat.index_select(0, at) - (p.frequency_penalty * counts + p.presence_penalty))


def row_argmax(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(dim=-1)`` of [N, V] scores; fp32 on the CPU through the C++ kernel (torch's
    reduction takes ~0.85 ms for 32 rows of a 49152-entry vocabulary, the kernel ~0.16)."""
    kernels, _ = cpu_kernels()
    if kernels is not None and scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 2:
        return kernels.argmax_rows(scores)
    return scores.argmax(dim=-1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of ``logits`` [N, V] (already processed); ``generators[i]`` is row i's rng (None: the global one)."""
    if all(p.temperature <= 0 for p in params):
        return row_argmax(logits)
    uniform = _uniforms(params, generators)
    kernels, _ = cpu_kernels()
    if kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        filters = ([p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params])
        return kernels.sample_rows(logits, *filters, uniform)  # a top_k of 0 is the whole vocabulary there too
    return _sample_with_torch(logits, params, uniform)


def _uniforms(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> list[float]:
    """Each sampling row's draw in [0, 1), from its own generator or, for the rows without
    one, the global generator (one call for them all); 0 for greedy rows, which draw nothing."""
    unseeded = [i for i, p in enumerate(params) if p.temperature > 0 and generators[i] is None]
    shared = iter(torch.rand(len(unseeded), dtype=torch.float64).tolist() if unseeded else [])
    draws = [0.0] * len(params)
    for i, p in enumerate(params):
        if p.temperature > 0:
            generator = generators[i]
            draws[i] = next(shared) if generator is None else torch.rand(1, generator=generator, dtype=torch.float64).item()
    return draws


def _sample_with_torch(logits: torch.Tensor, params: Sequence[SamplingParams], uniform: list[float]) -> torch.Tensor:
    """``sample`` in torch ops: the compiled kernel's reference, and its fallback off the CPU or without it."""
    greedy = row_argmax(logits)
    random_rows = [i for i, p in enumerate(params) if p.temperature > 0]
    rows = torch.tensor(random_rows, device=logits.device)
    chosen = [params[i] for i in random_rows]
    scaled = logits[rows].float() / torch.tensor([p.temperature for p in chosen], device=logits.device)[:, None]
    drawable = torch.isfinite(scaled.max(dim=-1).values)  # else NaN, +inf or only -inf: the row answers as greedy does
    keep = _filter_mask(scaled, chosen)
    if keep is not None:
        scaled.masked_fill_(~keep, float("-inf"))
    running = torch.softmax(scaled.double(), dim=-1).cumsum(dim=-1)
    target = torch.tensor([uniform[i] for i in random_rows], dtype=torch.float64, device=logits.device) * running[:, -1]
    drawn = torch.searchsorted(running, target[:, None], right=True).squeeze(1)
    # Rounding may leave a target unmet: the row's last kept token then.
    last_kept = scaled.shape[-1] - 1 - torch.isfinite(scaled).flip(-1).int().argmax(dim=-1)
    return greedy.index_copy_(0, rows, torch.where(drawable, drawn.minimum(last_kept), greedy[rows]))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]) -> list[TokenLogprobs | None]:
    """For rows that ask for logprobs: the sampled token's log-probability under ``logits`` (processed) and the
    ``params.logprobs`` most likely tokens', best first; None for the other rows."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    if len(rows) == len(params):  # every row asks: no copy (indexing copies rows at ~5 GB/s, as long as the kernel takes)
        asking, chosen_tokens = logits.float(), tokens.long()
    else:
        index = torch.tensor(rows)
        asking, chosen_tokens = logits[index].float(), tokens[index].long()
    k = min(max(params[i].logprobs or 0 for i in rows), logits.shape[-1])
    kernels, _ = cpu_kernels()
    if kernels is not None and asking.device.type == "cpu":
        chosen_t, values_t, ids_t, ok = kernels.logprobs_rows(asking, chosen_tokens, k)
        if not bool(ok.all()):  # rows with NaN or no finite logit: torch's answer (NaN where it gives NaN)
            bad = (~ok).nonzero().squeeze(1)
            chosen_t[bad], values_t[bad], ids_t[bad] = _torch_logprobs(asking[bad], chosen_tokens[bad], k)
    else:
        chosen_t, values_t, ids_t = _torch_logprobs(asking, chosen_tokens, k)
    chosen, top_values, top_ids = chosen_t.tolist(), values_t.tolist(), ids_t.tolist()
    for j, i in enumerate(rows):
        wanted = params[i].logprobs or 0
        out[i] = TokenLogprobs(chosen[j], top_ids[j][:wanted], top_values[j][:wanted])
    return out


def _torch_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's log-softmax at its token, and its ``k`` largest values with their ids: what the compiled
    ``logprobs_rows`` answers (~0.06 ms a row, never writing the whole log-softmax), by torch's ops (~0.15-0.25 ms)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    values, ids = logprobs.topk(k, dim=-1)
    return logprobs.gather(1, tokens[:, None]).squeeze(1), values, ids


FILTER_CANDIDATES = 1024  # the largest logits a top-k / top-p cut is first looked for among (a full sort costs ~4 ms a row)


def _filter_mask(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor | None:
    """Tokens that survive top-k, then top-p (of the top-k renormalised), then min-p; None: all do."""
    vocab = scaled.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    min_p = torch.tensor([p.min_p for p in params])
    keep = None
    if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
        keep = scaled >= _cut_logits(scaled, top_k, top_p)
    if bool((min_p > 0).any()):
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        floor = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
        keep = scaled >= floor if keep is None else keep & (scaled >= floor)
    return keep


def _cut_logits(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int = FILTER_CANDIDATES) -> torch.Tensor:
    """[N, 1]: each row's smallest kept logit under top-k, then top-p of the top-k renormalised.

    The kept set is a prefix of the row's descending order. It is looked for among the ``candidates``
    largest logits (a partial selection); the whole row is sorted (``candidates`` = the vocabulary)
    only when a row's cut may lie beyond them: a top-k larger than that, or a top-p that they do not
    hold enough probability for."""
    vocab = scaled.shape[-1]
    candidates = min(vocab, candidates)
    ordered = scaled.topk(candidates, dim=-1).values if candidates < vocab else scaled.sort(dim=-1, descending=True).values
    ordered.masked_fill_(torch.arange(candidates) >= top_k[:, None], float("-inf"))
    # Renormalised over the top-k when they are all candidates, else over the whole row.
    within_candidates = top_k <= candidates
    log_total = torch.where(within_candidates, torch.logsumexp(ordered, dim=-1), torch.logsumexp(scaled, dim=-1))
    probs = (ordered - log_total[:, None]).exp()
    mass = probs.cumsum(dim=-1)
    if not bool((within_candidates | ((top_k >= vocab) & ((top_p >= 1) | (mass[:, -1] >= top_p)))).all()):
        return _cut_logits(scaled, top_k, top_p, candidates=vocab)
    # A token stays while the mass ranked above it is below top_p (the first always stays). Rows
    # without top-p keep exactly top_k: a cumsum rounded past 1.0 must not trim them.
    within_p = ((mass - probs) < top_p[:, None]).sum(dim=-1).clamp_(1, None)
    count = torch.where(top_p < 1, within_p.minimum(top_k), top_k)
    cut = ordered.gather(1, (count.clamp(max=candidates) - 1)[:, None])
    return cut.masked_fill_((count > candidates)[:, None], float("-inf"))  # no top-k and no top-p: every token stays
