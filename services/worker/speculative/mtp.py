"""The ``mtp`` proposer: a Qwen3-Next checkpoint's multi-token-prediction layer (``mtp.*``) guesses each speculating
request's next tokens from the target's own hidden states.

The layer, as vLLM runs it: at position p it takes the embedding of token p + 1 and the target's final-normed hidden
state at p, RMS-norms each (``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``), projects their concatenation
[embedding | hidden] back to the hidden size (``fc``), runs one decoder layer (gated full attention and the MoE) and
norms the result (``norm``); the target's lm head turns that into the logits of token p + 2. For k > 1 it chains:
its own output hidden state and its guess are the next position's inputs.

Its KV is one attention layer's, in a cache of its own laid out as the target's (same block size and count) and
addressed through the request's own block table: position p of the MTP layer lives where position p of the target
does, so the scheduler hands out nothing more and a request's MTP KV comes and goes with its blocks. Under a device
memory budget it comes off the KV cache's share (a block costs one layer more).

Its positions: the runner hands it the target's hidden states of every position a step computes (``keep_hidden``).
MTP position p is computed once token p + 1 is known, in one batch over the requests: after the step's forward,
every position of each slice but its last, and the last ones of the step before. So a request's MTP KV holds every
position before its last token whether it speculates or not, and it keeps at most one step's hidden states (a
verify's: k + 1 rows). A proposal computes the position before the request's last token, takes the argmax of its
logits, then chains k − 1 decode steps at the next positions. The chained positions do not count as computed: the
target's hidden states of the positions a verify accepts recompute them, overwriting their KV; a verify's rejected
rows are dropped when the request's next slice starts before them.

Every proposal is an argmax (a point mass: rejection sampling accepts it with the target's probability of the
token), for greedy and sampled requests alike. A request resumed from the prefix cache starts its MTP positions at
its first computed one: the cached blocks hold whatever MTP KV an earlier request wrote there, which may lower
acceptance and never changes a token (every proposal is verified). The layer runs in the model's dtype whatever
``--weight-quant`` made of the target's linears, and no CUDA graph replays a step while it runs (it needs every
step's hidden states).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from services.worker.attention import AttentionMetadata, KVCache
from services.worker.linear import Linear
from services.worker.models import CausalLM
from services.worker.request_table import RequestTable
from services.worker.sampling import row_argmax
from services.worker.weights import weight_files
from shared.model_info import is_gguf

MTP_FAMILIES = ("qwen3_next",)  # the families whose checkpoints ship an MTP layer this proposer runs


@dataclass
class _Track:
    """One request as the MTP layer knows it: its tokens, the positions whose MTP KV is computed, and the target's
    hidden states of the positions after them (``hidden[i]`` is position ``computed + i``'s)."""

    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    hidden: torch.Tensor | None = None

    @property
    def ready(self) -> int:
        """Positions the layer can compute now: those with a hidden state whose next token is known."""
        held = 0 if self.hidden is None else self.hidden.shape[0]
        return max(0, min(held, len(self.tokens) - 1 - self.computed))


class MTPProposer:
    name = "mtp"

    def __init__(self, model: CausalLM, weights: dict[str, torch.Tensor], requests: RequestTable, block_size: int) -> None:
        self.model, self.requests, self.block_size = model, requests, block_size  # the runner's table: each request's blocks
        self.device = model.embed.device
        self.layer = model.mtp_layer(weights)
        self.fc = Linear(weights["mtp.fc.weight"], model.cfg.threads)  # [hidden, 2·hidden]: [embedding | hidden state] in
        self.pre_fc_norm_embedding = model.rms_norm(weights["mtp.pre_fc_norm_embedding.weight"])
        self.pre_fc_norm_hidden = model.rms_norm(weights["mtp.pre_fc_norm_hidden.weight"])
        self.norm = model.rms_norm(weights["mtp.norm.weight"])
        self.kv_cache: KVCache | None = None
        self._tracks: dict[str, _Track] = {}

    @classmethod
    def load(cls, path: str, family: str, model: CausalLM, requests: RequestTable, block_size: int) -> MTPProposer:
        """The MTP layer of the checkpoint at ``path`` (its ``mtp.*`` tensors, in the model's dtype and device); a
        ``ValueError`` saying why where it has none."""
        if family not in MTP_FAMILIES:
            raise ValueError(f"speculative method 'mtp' runs the MTP layer of {', '.join(MTP_FAMILIES)} checkpoints; a {family} model has none")
        if is_gguf(path):
            raise ValueError("speculative method 'mtp' reads the mtp.* tensors of a Hugging Face checkpoint directory, not a GGUF file")
        weights = {}
        for file in weight_files(path):
            with safe_open(file, "pt") as f:
                for name in f.keys():
                    if name.startswith("mtp."):
                        weights[name] = f.get_tensor(name).to(model.embed.device, model.dtype, copy=True)
        if "mtp.fc.weight" not in weights:
            raise ValueError(f"{path} holds no MTP layer (no mtp.fc.weight): speculative method 'mtp' needs a checkpoint that ships one")
        if any(name.startswith("mtp.layers.1.") for name in weights):
            raise ValueError(f"{path} holds more than one MTP layer; speculative method 'mtp' runs one")
        return cls(model, weights, requests, block_size)

    def allocate(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        """Its KV cache, as many blocks as the target's (done again when the target's is rebuilt)."""
        model = self.model
        self.kv_cache = None  # the old tensor goes before the new one is made
        self.kv_cache = KVCache(1, num_blocks, self.block_size, model.num_kv_heads, model.head_dim, kv_dtype, self.device)

    def extend(self, rid: str, token_ids: Sequence[int]) -> None:
        """Tokens the request now has beyond those given before (prompt, recomputed outputs, sampled tokens)."""
        self._tracks.setdefault(rid, _Track()).tokens.extend(token_ids)

    def keep_hidden(self, spans: list[tuple[str, int, int]], hidden: torch.Tensor) -> None:
        """The step's target hidden states [rows, hidden]: ``spans`` gives each slice's (rid, first position, rows) in
        row order. Then every position whose next token is known is computed."""
        if self.kv_cache is None:  # the profile step of a device budget, before any KV cache exists
            return
        row = 0
        for rid, start, n in spans:
            track = self._tracks.setdefault(rid, _Track())
            rows = hidden[row : row + n]
            row += n
            held = 0 if track.hidden is None else track.hidden.shape[0]
            if not track.computed <= start <= track.computed + held:  # a first slice, or one past a gap: start over there
                track.computed, track.hidden = start, rows.clone()
            else:  # a slice that starts at p recomputes every position from p on: rows past it were rejected
                track.hidden = torch.cat([track.hidden[: start - track.computed], rows]) if held else rows.clone()
        self._catch_up(list(self._tracks))

    def propose(self, wanted: dict[str, int]) -> dict[str, list[int]]:
        """Up to ``wanted[rid]`` tokens for each request whose MTP positions reach its last token."""
        last = self._catch_up(list(wanted))
        active = [rid for rid in wanted if rid in last and self._tracks[rid].computed == len(self._tracks[rid].tokens) - 1 and wanted[rid] > 0]
        proposals: dict[str, list[int]] = {rid: [] for rid in active}
        step = 0
        while active:
            hidden = torch.stack([last[rid] for rid in active])
            tokens = row_argmax(self.model.compute_logits(hidden).float()).tolist()
            for rid, token in zip(active, tokens):
                proposals[rid].append(token)
            active = [rid for rid in active if len(proposals[rid]) < wanted[rid]]
            if not active:
                break
            # The next position of each: the guess and the layer's own output hidden state, one decode batch.
            starts = [self._tracks[rid].computed + step for rid in active]
            out = self._forward([proposals[rid][-1] for rid in active], torch.stack([last[rid] for rid in active]), starts, [1] * len(active), active)
            last = dict(zip(active, out))
            step += 1
        return proposals

    def release(self, rid: str) -> None:
        self._tracks.pop(rid, None)

    def describe(self) -> dict[str, Any]:
        return {"kv_cache_bytes": None if self.kv_cache is None else self.kv_cache.nbytes}

    def _catch_up(self, rids: list[str]) -> dict[str, torch.Tensor]:
        """Compute the ready positions of these requests in one batch; each one's output hidden state at its last."""
        counts = {rid: n for rid in rids if rid in self.requests and (n := self._tracks[rid].ready) > 0}
        if not counts:
            return {}
        # Single positions first: attention runs them as one decode batch.
        order = sorted(counts, key=lambda rid: counts[rid] > 1 or self._tracks[rid].computed == 0)
        tracks = [self._tracks[rid] for rid in order]
        lens = [counts[rid] for rid in order]
        tokens = [token for t, n in zip(tracks, lens) for token in t.tokens[t.computed + 1 : t.computed + 1 + n]]
        hidden = torch.cat([t.hidden[:n] for t, n in zip(tracks, lens)])
        out = self._forward(tokens, hidden, [t.computed for t in tracks], lens, order)
        ends = list(itertools.accumulate(lens))
        for t, n in zip(tracks, lens):
            t.computed += n
            t.hidden = t.hidden[n:]
        return {rid: out[end - 1] for rid, end in zip(order, ends)}

    def _forward(self, token_ids: list[int], hidden: torch.Tensor, starts: list[int], lens: list[int], rids: list[str]) -> torch.Tensor:
        """The layer's final-normed output [rows, hidden] at each request's positions from ``starts``: token p + 1's
        embedding and the hidden state of p in, its KV written at p."""
        model = self.model
        num_decodes = sum(1 for _ in itertools.takewhile(lambda j: lens[j] == 1 and starts[j] > 0, range(len(lens))))
        tables = [self.requests[rid].table for rid in rids]
        meta = AttentionMetadata.build(starts, lens, tables, num_decodes, self.block_size, model.dtype, self.device, model.attention_backend)
        embedded = self.pre_fc_norm_embedding(F.embedding(torch.tensor(token_ids, device=self.device), model.embed))
        x = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = model.rotary.lookup(meta.positions, meta.max_position)
        layer = self.layer
        x = layer.attn(layer.input_norm(x), x, cos, sin, meta, self.kv_cache.layers[0])
        x = layer.mlp(layer.post_norm(x), x)
        return self.norm(x)
