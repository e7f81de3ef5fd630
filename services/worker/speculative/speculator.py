"""The runner's side of speculative decoding: which slices of a step verify proposed tokens, and their tokens after.

A decode slice whose ``num_tokens`` is above 1 may verify up to ``num_tokens - 1`` proposed tokens (the
scheduler's choice: ``services/scheduler/speculation.py``). The speculator keeps every request's tokens for
its proposer, asks it for proposals, and turns each such slice into a chunk of the request's last token and
its proposal, whose logits at every position the verifier reads. A slice with no proposal runs as a plain
decode. After the step the request's computed positions end at its last accepted token, and its block table
drops the blocks past them, as the scheduler's does (``services/scheduler/speculation.py``, ``blocks_kept``); so
does its draft model's table with method ``draft`` (``draft.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
import torch
from prometheus_client import Counter

from services.worker.gdn_state import SlotMetadata
from services.worker.request_table import RequestState, RequestTable
from services.worker.speculative.draft import DraftProposer
from services.worker.speculative.mtp import MTPProposer
from services.worker.speculative.ngram import NgramProposer
from services.worker.speculative.verifier import Verified, verify
from shared.frames import Slice
from shared.metrics import PREFIX

# vLLM's names: proposals verified, tokens proposed, tokens accepted, and accepted by position in the proposal.
DRAFTS = Counter(f"{PREFIX}spec_decode_num_drafts", "Speculative steps that verified a proposal")
DRAFT_TOKENS = Counter(f"{PREFIX}spec_decode_num_draft_tokens", "Proposed tokens verified")
ACCEPTED_TOKENS = Counter(f"{PREFIX}spec_decode_num_accepted_tokens", "Proposed tokens accepted")
ACCEPTED_PER_POSITION = Counter(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, by position in the proposal", ["position"])

SPECULATIVE_METHODS = ("ngram", "draft", "mtp")


class Verify(NamedTuple):
    """A slice that verifies a proposal: its request and the tokens the step feeds ([last token, *proposal])."""

    slice: Slice
    request: RequestState
    proposal: list[int]
    probs: torch.Tensor | None = None  # the proposer's distribution of each proposed token [len(proposal), V]; None: each one certain

    @property
    def token_ids(self) -> list[int]:
        return [self.request.last_token, *self.proposal]


class Speculator:
    def __init__(
        self, method: str, ngram_min: int, ngram_max: int, block_size: int, draft: DraftProposer | None = None, mtp: MTPProposer | None = None
    ) -> None:
        """``draft``: the loaded draft model, which method "draft" proposes with (its KV blocks come in ``Slice.draft_blocks``);
        ``mtp``: the checkpoint's MTP layer, which method "mtp" proposes with."""
        if method not in SPECULATIVE_METHODS or (method == "draft") != (draft is not None) or (method == "mtp") != (mtp is not None):
            raise ValueError(
                f"speculative method {method!r} is not one this worker runs (choices: {', '.join(SPECULATIVE_METHODS)}; draft with a draft model, mtp with an MTP layer)"
            )
        self.method = method
        self.proposer = draft or mtp or NgramProposer(ngram_min, ngram_max)
        self.draft, self.mtp = draft, mtp
        self._probs = draft.probs if draft is not None else lambda rid: None
        self.ngram = [ngram_min, ngram_max]
        self.block_size = block_size
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.accepted_per_position: list[int] = []

    @staticmethod
    def as_decodes(slices: list[Slice]) -> list[Slice]:
        """The step's slices with each speculative one as the plain decode it starts with (what the request table checks and records)."""
        return [msgspec.structs.replace(s, num_tokens=1) if _speculative(s) else s for s in slices]

    def check(self, slices: list[Slice], table: RequestTable) -> None:
        """A ``ValueError`` where a speculative slice reaches past its request's blocks (the table checks the rest)."""
        for s in slices:
            if _speculative(s):
                request = table.get(s.rid)
                capacity = (len(request.table) if request else 0) + len(s.new_blocks)
                if s.start + s.num_tokens > capacity * self.block_size:
                    raise ValueError(
                        f"speculative slice for {s.rid!r} reaches position {s.start + s.num_tokens - 1} but its {capacity} blocks hold {capacity * self.block_size} tokens"
                    )
                drafted = (len(request.draft_table) if request else 0) + len(s.draft_blocks)
                if self.draft is not None and s.start + s.num_tokens > drafted * self.block_size:
                    raise ValueError(
                        f"speculative slice for {s.rid!r} reaches position {s.start + s.num_tokens - 1} but its {drafted} draft blocks hold {drafted * self.block_size} tokens"
                    )

    def observe(self, slices: list[Slice]) -> None:
        """The tokens the step's prefill chunks bring (and, on a request's first slice, its cached prefix)."""
        for s in slices:
            if s.sampling is not None and s.prefix_ids:
                self.proposer.extend(s.rid, s.prefix_ids)
            if s.token_ids:
                self.proposer.extend(s.rid, s.token_ids)

    def propose(self, slices: list[Slice], table: RequestTable) -> dict[str, Verify]:
        """The step's verifies, by rid: its speculative slices that got a proposal (a structured output gets none)."""
        speculative = {s.rid: s for s in slices if _speculative(s)}
        if not speculative:
            return {}
        proposals = self.proposer.propose({rid: s.num_tokens - 1 for rid, s in speculative.items() if table[rid].grammar is None})
        for rid in speculative.keys() - proposals.keys():  # a plain decode: its blocks past its next position go back
            self._trim(table[rid])
        return {rid: Verify(speculative[rid], table[rid], proposal, self._probs(rid)) for rid, proposal in proposals.items()}

    @staticmethod
    def proposed(slices: list[Slice], verifies: list[Verify]) -> dict[str, int]:
        """Each speculative slice's proposed tokens, 0 where it got none (only a proposal that was verified tells the scheduler how often proposals hold)."""
        proposed = {s.rid: 0 for s in slices if _speculative(s)}
        proposed.update((v.slice.rid, len(v.proposal)) for v in verifies)
        return proposed

    def no_guess(self, rids: Sequence[str]) -> list[str]:
        """Those of ``rids`` whose next tokens prompt lookup has no proposal for (the scheduler plans them no verify);
        a model proposer always has one."""
        if not isinstance(self.proposer, NgramProposer):
            return []
        return [rid for rid in dict.fromkeys(rids) if not self.proposer.has_guess(rid)]

    def sampled(self, rids: Sequence[str], tokens: Sequence[int]) -> None:
        for rid, token in zip(rids, tokens):
            self.proposer.extend(rid, [token])

    def verify(self, verifies: list[Verify], logits: list[torch.Tensor], states: SlotMetadata | None = None) -> dict[str, Verified]:
        """Each verify's tokens from its logits [len(proposal) + 1, V]; its request ends at its last accepted token,
        and with a hybrid model's ``states`` its GDN slot holds the state after that token."""
        out = {}
        for i, (v, rows) in enumerate(zip(verifies, logits)):
            verified = out[v.slice.rid] = verify(rows, v.proposal, v.request, v.probs)
            if states is not None:
                states.keep_accepted(i, verified.accepted)
            v.request.end = v.slice.start + len(verified.tokens)
            self._trim(v.request)
            self.proposer.extend(v.slice.rid, verified.tokens)
            self._count(len(v.proposal), verified.accepted)
        return out

    def _trim(self, request: RequestState) -> None:
        """The request's block tables (its draft's too) keep the blocks of its computed positions (the scheduler's ``blocks_kept``)."""
        keep = -(-request.end // self.block_size)
        del request.table[keep:], request.draft_table[keep:]

    def _count(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        DRAFTS.inc()
        DRAFT_TOKENS.inc(proposed)
        ACCEPTED_TOKENS.inc(accepted)
        while len(self.accepted_per_position) < proposed:
            self.accepted_per_position.append(0)
        for position in range(accepted):
            self.accepted_per_position[position] += 1
            ACCEPTED_PER_POSITION.labels(str(position)).inc()

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self.proposer.release(rid)

    def describe(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "ngram": self.ngram,
            "draft": None if self.draft is None else self.draft.describe(),
            "mtp": None if self.mtp is None else self.mtp.describe(),
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.accepted_tokens / self.draft_tokens, 4) if self.draft_tokens else None,
            "accepted_per_position": self.accepted_per_position,
        }


def _speculative(s: Slice) -> bool:
    return not s.token_ids and s.num_tokens > 1
