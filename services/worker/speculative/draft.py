"""The ``draft`` proposer: a small model of the target's tokenizer, run by the same worker, guesses each
speculating request's next tokens.

Its KV lives in a cache of its own, in blocks the scheduler hands out from a second pool
(``services/scheduler/draft_blocks.py``): the same block size and positions as the target's, sent in
``Slice.draft_blocks`` into the request's ``draft_table``, cut back after a verify as the target's table is, and
gone with the request (finish, abort, preemption). The draft catches up lazily: it hears every token of each
request, as prompt lookup does, and keeps the positions it has computed. A proposal first runs it over the
tokens it has not computed (the whole prompt the first time, a long one in pieces; after a verify, the tokens past
its accepted proposals), in one batch over the step's speculating requests, then chains decode steps, batched the
same way, until each request has its k tokens. A greedy request gets the draft's argmax; a sampled one a draw from the
draft's distribution q (its temperature, top-k, top-p and min-p over the draft's logits), and q goes to the
rejection sampler (``verifier.verify``'s ``draft_probs``), so its tokens keep the target's distribution.

After a verify, the draft's computed positions end where the proposals it was fed stop matching the request's
tokens: at its accepted tokens. Its KV past them is overwritten by the next catch-up.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from services.worker.attention import AttentionMetadata, KVCache
from services.worker.decoder_backends import select_decoder_backend
from services.worker.models import CausalLM
from services.worker.request_table import RequestState, RequestTable
from services.worker.sampling import row_argmax
from services.worker.speculative.verifier import draw, target_probs
from services.worker.weights_loading import load_model
from shared.model_info import is_gguf, load_model_info
from shared.tokenizer import load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
CATCH_UP_TOKENS = 512  # the most of one request's tokens a draft forward computes: a longer catch-up runs in pieces first


@dataclass
class _Track:
    """One request as the draft knows it: its tokens, the positions whose KV the draft holds, and the proposals it
    computed past its tokens (valid only while the request's next tokens equal them)."""

    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    fed: list[int] = field(default_factory=list)


class DraftProposer:
    name = "draft"

    def __init__(self, path: str, model: CausalLM, requests: RequestTable, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        self.path, self.model, self.requests = path, model, requests  # the runner's table: each request's draft_table
        self.block_size, self.num_blocks = block_size, num_blocks
        self.device = model.embed.device
        self.decoder = select_decoder_backend(model, sharded=False)
        self.kv_cache = KVCache(model.num_kv_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim, kv_dtype, self.device)
        self._tracks: dict[str, _Track] = {}
        self._probs: dict[str, torch.Tensor] = {}  # the last proposal's q of each sampled request [k, V]

    @classmethod
    def load(
        cls, path: str, target_path: str, target: CausalLM, requests: RequestTable, dtype: torch.dtype, weight_quant: str, kv_dtype: torch.dtype,
        num_blocks: int, block_size: int,
    ) -> DraftProposer:  # fmt: skip
        """The draft at ``path``, loaded as the target was (dtype, device, weight format); a ``ValueError`` saying why
        where it cannot serve as the target's draft."""
        if not path:
            raise ValueError("speculative method 'draft' needs --draft-model, the directory of a small model with the model's tokenizer")
        if not os.path.exists(path):
            raise ValueError(f"draft model {path!r} does not exist")
        vocab_size = load_model_info(path).vocab_size
        if vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model {path!r} has a vocabulary of {vocab_size} tokens but the model {target.vocab_size}: a draft must share the model's tokenizer"
            )
        why = _tokenizers_differ(path, target_path)
        if why:
            raise ValueError(f"draft model {path!r} does not share the model's tokenizer: {why}")
        _, model, _, _ = load_model(path, dtype, target.embed.device, weight_quant, None)
        if model.gdn_shape is not None:
            raise ValueError(f"draft model {path!r} has Gated DeltaNet layers: a draft must be a model of attention layers alone")
        if kv_dtype == torch.int8:  # the model's quantized KV needs a kernel and a head_dim the draft may not have
            kv_dtype = torch.float16 if model.dtype == torch.float32 else model.dtype
        return cls(path, model, requests, num_blocks, block_size, kv_dtype)

    def extend(self, rid: str, token_ids: Sequence[int]) -> None:
        """Tokens the request now has beyond those given before; the proposals computed past its tokens stay
        computed as far as these equal them."""
        track = self._tracks.get(rid)
        if track is None:
            track = self._tracks[rid] = _Track()
        base = len(track.tokens)
        track.tokens.extend(token_ids)
        matched = sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(track.fed, token_ids)))
        track.computed, track.fed = min(track.computed, base + matched), []

    def propose(self, wanted: dict[str, int]) -> dict[str, list[int]]:
        """``wanted[rid]`` tokens for each request, one batched draft forward per token."""
        self._probs = {}
        self._catch_up([rid for rid, count in wanted.items() if count > 0])
        # The catch-up's single tokens first: attention runs them as one decode batch.
        active = sorted((rid for rid, count in wanted.items() if count > 0), key=lambda rid: self._catch_up_is_chunk(self._tracks[rid]))
        inputs = {rid: self._tracks[rid].tokens[self._tracks[rid].computed :] for rid in active}
        proposals: dict[str, list[int]] = {rid: [] for rid in active}
        qs: dict[str, list[torch.Tensor]] = {rid: [] for rid in active}
        while active:
            tracks = [self._tracks[rid] for rid in active]
            logits = self._forward([t.computed for t in tracks], [inputs[rid] for rid in active], [self.requests[rid].draft_table for rid in active])
            for rid, track, row in zip(active, tracks, logits):
                track.computed += len(inputs[rid])
                token, q = _choose(row, self.requests[rid])
                proposals[rid].append(token)
                if q is not None:
                    qs[rid].append(q)
            active = [rid for rid in active if len(proposals[rid]) < wanted[rid]]
            inputs = {rid: proposals[rid][-1:] for rid in active}
        for rid, proposal in proposals.items():
            self._tracks[rid].fed = proposal[:-1]
        self._probs = {rid: torch.stack(q) for rid, q in qs.items() if q}
        return proposals

    def probs(self, rid: str) -> torch.Tensor | None:
        """The draft's distribution of each token of the request's last proposal [k, V]; None for a greedy request."""
        return self._probs.get(rid)

    def release(self, rid: str) -> None:
        self._tracks.pop(rid, None)

    def describe(self) -> dict[str, Any]:
        return {"model": self.path, "kv_blocks": self.num_blocks, "kv_cache_bytes": self.kv_cache.nbytes, "vocab_size": self.model.vocab_size}

    def _catch_up(self, rids: list[str]) -> None:
        """Computes the requests' unseen tokens but the last ``CATCH_UP_TOKENS``, that many at a time (the proposing
        forward computes the rest), so a long prompt never makes one huge forward."""
        while rids := [rid for rid in rids if len(self._tracks[rid].tokens) - self._tracks[rid].computed > CATCH_UP_TOKENS]:
            tracks = [self._tracks[rid] for rid in rids]
            pieces = [t.tokens[t.computed : t.computed + CATCH_UP_TOKENS] for t in tracks]
            self._forward([t.computed for t in tracks], pieces, [self.requests[rid].draft_table for rid in rids])
            for track in tracks:
                track.computed += CATCH_UP_TOKENS

    @staticmethod
    def _catch_up_is_chunk(track: _Track) -> bool:
        return len(track.tokens) - track.computed > 1 or track.computed == 0

    def _forward(self, starts: list[int], inputs: list[list[int]], tables: list[list[int]]) -> torch.Tensor:
        """The draft's logits [len(inputs), V] after each request's input tokens, computed from ``starts``."""
        lens = [len(tokens) for tokens in inputs]
        num_decodes = sum(1 for _ in itertools.takewhile(lambda j: lens[j] == 1 and starts[j] > 0, range(len(lens))))
        model = self.model
        meta = AttentionMetadata.build(starts, lens, tables, num_decodes, self.block_size, model.dtype, self.device, model.attention_backend)
        input_ids = torch.tensor([t for tokens in inputs for t in tokens], device=self.device)
        hidden = self.decoder(input_ids, meta.positions, meta, self.kv_cache, None)
        if hidden.shape[0] > len(inputs):
            hidden = hidden.index_select(0, torch.tensor(list(itertools.accumulate(lens)), device=self.device) - 1)
        return model.compute_logits(hidden)


def _choose(row: torch.Tensor, request: RequestState) -> tuple[int, torch.Tensor | None]:
    """The draft's token at one row and, for a sampled request, the distribution it was drawn from."""
    params = request.params
    if params.temperature <= 0:
        return int(row_argmax(row[None].float())[0]), None
    q = target_probs(row, params)
    if q is None:
        return int(row_argmax(row[None].float())[0]), _certain(row)
    return draw(q, request.generator), q


def _certain(row: torch.Tensor) -> torch.Tensor:
    """The point mass at the row's argmax: what a draft with no finite logit proposes from."""
    q = torch.zeros(row.shape[-1], dtype=torch.float64, device=row.device)
    q[int(row.argmax())] = 1.0
    return q


def _tokenizers_differ(draft_path: str, target_path: str) -> str:
    """Why the two models' tokenizers differ ("" where they agree, or either directory holds none)."""
    vocabularies = []
    for path in (draft_path, target_path):
        if not is_gguf(path) and not any(os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES):
            return ""
        vocabularies.append(load_tokenizer(path).get_vocab())
    draft, target = vocabularies
    if draft == target:
        return ""
    differ = sorted(token for token in draft.keys() | target.keys() if draft.get(token) != target.get(token))
    return f"{len(differ)} tokens have other ids or are missing (first: {differ[0]!r})"
