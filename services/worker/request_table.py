"""Each running request's state on this rank (block table, last sampled token, sampling state, GDN slot),
and the checks that refuse a malformed plan before it changes any of it."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.worker.sampling import LogitBias, TokenHistory
from services.worker.structured import GrammarState
from shared.frames import SamplingParams, Slice

ALL_PROMPT = 1 << 62  # a prompt_len no prefill reaches: every prefilled token is prompt


class Grammars(Protocol):
    """Structured outputs where this rank samples (``sampler.Sampler``): a request's grammar compiled (a
    ``ValueError`` for one it cannot take), where a request starts in it, and a step along it."""

    def check(self, params: SamplingParams) -> None: ...

    def start(self, params: SamplingParams) -> GrammarState: ...

    def advance(self, state: GrammarState, token: int) -> GrammarState: ...


@dataclass
class RequestState:
    params: SamplingParams
    generator: torch.Generator | None
    history: TokenHistory | None = None  # only for requests with penalties
    bias: LogitBias | None = None
    prompt_len: int = 0  # prefill positions before this are prompt, later ones recomputed outputs
    table: list[int] = field(default_factory=list)
    draft_table: list[int] = field(default_factory=list)  # the draft model's blocks (speculative_method draft)
    last_token: int | None = None
    end: int = 0  # positions computed so far: where the next slice must start
    slot: int = -1  # GDN state slot (hybrid models)
    noise_seed: int = 0  # the device sampler's noise stream (the params' seed, else random)
    draws: int = 0  # tokens sampled so far
    grammar: GrammarState | None = None  # structured outputs: where the output is in its grammar

    @classmethod
    def start(cls, s: Slice) -> RequestState:
        params = s.sampling or SamplingParams()
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        history = TokenHistory(params) if params.penalised else None
        request = cls(params, generator, history, LogitBias.of(params.logit_bias), s.prompt_len or ALL_PROMPT)
        request.noise_seed = random.getrandbits(62) if params.seed is None else params.seed
        return request

    def record_prefill(self, start: int, token_ids: list[int], grammars: Grammars | None) -> None:
        """Tells the penalty history and the grammar about a prefill chunk: prompt tokens, then (after a
        preemption) earlier outputs."""
        if self.history is None and self.grammar is None:
            return
        split = max(0, min(len(token_ids), self.prompt_len - start))
        if self.history is not None:
            self.history.add_prompt(token_ids[:split])
            self.history.add_outputs(token_ids[split:])
        if self.grammar is not None and grammars is not None:
            for token in token_ids[split:]:
                self.grammar = grammars.advance(self.grammar, token)

    def record_sampled(self, token: int) -> None:
        self.last_token = token
        self.draws += 1
        if self.history is not None:
            self.history.add_outputs([token])


@dataclass(frozen=True)
class PlanLimits:
    """What a plan's slices must stay within on this runner."""

    max_num_seqs: int
    block_size: int
    num_blocks: int
    vocab_size: int
    num_slots: int | None  # GDN state slots the scheduler hands out; None: the model has no GDN layers
    num_checkpoints: int = 0  # GDN state checkpoints of the prefix cache
    num_draft_blocks: int = 0  # the draft model's KV blocks (speculative_method draft)


class RequestTable:
    """The requests this rank holds, by rid, and which live request computes in each GDN state slot."""

    def __init__(self) -> None:
        self._requests: dict[str, RequestState] = {}
        self.slot_holders: dict[int, str] = {}  # GDN slot -> the live request computing in it

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[str]:
        return iter(self._requests)

    def __getitem__(self, rid: str) -> RequestState:
        return self._requests[rid]

    def get(self, rid: str) -> RequestState | None:
        return self._requests.get(rid)

    def admit(self, slices: list[Slice], hybrid: bool, grammars: Grammars | None) -> None:
        """Record a validated step's slices: new requests start (with their grammar where this rank samples,
        ``grammars``), every slice extends its request's table and end."""
        for s in slices:
            request = self._requests.get(s.rid)
            if request is None:
                request = self._requests[s.rid] = RequestState.start(s)
                if request.params.grammar is not None and grammars is not None:
                    request.grammar = grammars.start(request.params)
                request.record_prefill(0, s.prefix_ids, grammars)
            request.table.extend(s.new_blocks)
            request.draft_table.extend(s.draft_blocks)
            request.record_prefill(s.start, s.token_ids, grammars)
            request.end = s.start + s.num_tokens
            if hybrid:
                request.slot = s.slot
                self.slot_holders[s.slot] = s.rid

    def release(self, rids: list[str]) -> None:
        """Forget these requests (unknown ones are ignored: a release may follow a failed step)."""
        for rid in rids:
            request = self._requests.pop(rid, None)
            if request is not None and self.slot_holders.get(request.slot) == rid:
                del self.slot_holders[request.slot]

    def validate(self, slices: list[Slice], limits: PlanLimits, grammars: Grammars | None) -> None:
        """A ``ValueError`` naming the first way ``slices`` break the contract; where this rank samples
        (``grammars``), a grammar it cannot compile is one."""
        if len(slices) > limits.max_num_seqs:
            raise ValueError(f"a step of {len(slices)} slices exceeds max_num_seqs={limits.max_num_seqs}")
        if len({s.rid for s in slices}) != len(slices):
            raise ValueError("a step holds more than one slice of the same request")
        if limits.num_slots is not None and len({s.slot for s in slices}) != len(slices):
            raise ValueError("a step holds two slices in the same GDN state slot")
        vocab, block_size = limits.vocab_size, limits.block_size
        for s in slices:
            request = self._requests.get(s.rid)
            if not s.token_ids:
                if request is None:
                    raise ValueError(f"decode slice for unknown request {s.rid!r}: it was never prefilled here or was released")
                if request.last_token is None:
                    raise ValueError(f"decode slice for request {s.rid!r}, which has not sampled a token yet")
                if s.num_tokens != 1:
                    raise ValueError(f"decode slice for {s.rid!r} has num_tokens={s.num_tokens}, expected 1")
            elif len(s.token_ids) != s.num_tokens:
                raise ValueError(f"slice for {s.rid!r} carries {len(s.token_ids)} token ids but num_tokens={s.num_tokens}")
            elif min(s.token_ids) < 0 or max(s.token_ids) >= vocab:
                raise ValueError(f"slice for {s.rid!r} carries token ids outside the vocabulary of {vocab}")
            if s.start < 0 or s.num_tokens < 1:
                raise ValueError(f"slice for {s.rid!r} has start={s.start}, num_tokens={s.num_tokens}")
            if request is not None and s.start != request.end:
                raise ValueError(f"slice for {s.rid!r} starts at {s.start} but the request has computed {request.end} positions")
            if s.sampling is not None and any(not 0 <= t < vocab for t in [*s.sampling.logit_bias, *s.prefix_ids]):
                raise ValueError(f"slice for {s.rid!r} names token ids (logit_bias or prefix_ids) outside the vocabulary of {vocab}")
            if limits.num_slots is not None:
                self._validate_slot(s, request, limits.num_slots, limits.num_checkpoints)
            if s.sampling is not None and s.sampling.grammar is not None and grammars is not None:
                grammars.check(s.sampling)  # a grammar it cannot compile: a bad plan (compiled ahead, it is a cache hit)
            if any(not 0 <= b < limits.num_blocks for b in s.new_blocks):
                raise ValueError(f"slice for {s.rid!r} names blocks outside 0..{limits.num_blocks - 1}: {s.new_blocks}")
            if any(not 0 <= b < limits.num_draft_blocks for b in s.draft_blocks):
                raise ValueError(f"slice for {s.rid!r} names draft blocks outside 0..{limits.num_draft_blocks - 1}: {s.draft_blocks}")
            capacity = (len(request.table) if request else 0) + len(s.new_blocks)
            if s.start + s.num_tokens > capacity * block_size:
                raise ValueError(
                    f"slice for {s.rid!r} reaches position {s.start + s.num_tokens - 1} but its "
                    f"{capacity} blocks of {block_size} hold {capacity * block_size} tokens"
                )

    def _validate_slot(self, s: Slice, request: RequestState | None, num_slots: int, num_checkpoints: int) -> None:
        if not 0 <= s.slot < num_slots:
            raise ValueError(f"slice for {s.rid!r} names GDN state slot {s.slot}, outside 0..{num_slots - 1}")
        if s.restore >= 0 and (request is not None or s.start == 0 or s.restore >= num_checkpoints):
            raise ValueError(f"slice for {s.rid!r} restores GDN checkpoint {s.restore}: only a new request's first slice past 0 may (0..{num_checkpoints - 1})")
        if request is None and s.start > 0 and s.restore < 0:
            raise ValueError(f"slice for {s.rid!r} starts at {s.start} but the worker holds no GDN state of it (a new request starts at 0 or restores)")
        positions = [p for p, _ in s.checkpoints]
        if s.checkpoints and (
            not s.token_ids or positions != sorted(set(positions)) or not s.start < positions[0] or positions[-1] > s.start + s.num_tokens
            or any(not 0 <= c < num_checkpoints for _, c in s.checkpoints)
        ):  # fmt: skip
            raise ValueError(f"slice for {s.rid!r} saves GDN checkpoints {s.checkpoints} out of its chunk, out of order or outside 0..{num_checkpoints - 1}")
        if request is not None and request.slot != s.slot:
            raise ValueError(f"slice for {s.rid!r} names GDN state slot {s.slot} but the request holds slot {request.slot}")
        holder = self.slot_holders.get(s.slot, s.rid)
        if holder != s.rid:
            raise ValueError(f"slice for {s.rid!r} names GDN state slot {s.slot}, which request {holder!r} holds")
