"""The tokens each step samples, on their way to the process that makes the text (the api, or the detokenizer):
after every step, or gathered over several.

Each frame to the text maker wakes it (and the api, where a detokenizer makes the text), then the client, once
per frame however many tokens it carries. With ``--stream-interval N`` (vLLM and SGLang have an option of that name) a request's tokens
are gathered over up to N steps into one delta, which reaches the client as one chunk: fewer wake-ups per
token where a step is short (a few streams on a CPU), for a burstier stream. A token waits at most N - 1
steps, and some not at all: a step that samples a request's first token (at the end of its prefill, which
may span several steps; the time to first token is unchanged) or a request's stop token sends what is
gathered at once, and the worker sends it too before it releases requests and whenever it has no frame
queued (it would otherwise hold tokens while idle). A request's opening goes with its first token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from shared.frames import StepPlan, StepResult, StreamOpen, TokenBatch, TokenDelta
from shared.stream_contract import ends_run
from shared.transport import ReplyOutboxes


class TokenStream:
    def __init__(self, send: Callable[[TokenBatch], None], interval: int, stop_token_ids: Mapping[str, frozenset[int]]) -> None:
        self.send = send
        self.interval = interval
        self.stop_token_ids = stop_token_ids  # each running request's, kept by PlanRuns
        self.opened: list[StreamOpen] = []
        self.deltas: dict[str, TokenDelta] = {}  # rid -> its tokens gathered so far, in order
        self.steps = 0  # steps gathered since the last send

    def add(self, plan: StepPlan, result: StepResult) -> None:
        """After each step (of a run too): the requests it opened and the tokens it sampled."""
        if result.error:
            return  # the scheduler fails the step's requests
        self.opened += [s.opened for s in plan.slices if s.opened is not None]
        prefills = {s.rid for s in plan.slices if s.token_ids}  # a prefill chunk that samples ends the prefill
        now = False  # a first token or a stop token: send at once
        for s in result.sampled:
            held = self.deltas.get(s.rid)
            if held is None:
                self.deltas[s.rid] = TokenDelta(s.rid, [s.token_id], logprobs=[] if s.logprobs is None else [s.logprobs])
            else:
                held.token_ids.append(s.token_id)
                if s.logprobs is not None:
                    held.logprobs.append(s.logprobs)
            now = now or s.rid in prefills or ends_run(s.token_id, self.stop_token_ids.get(s.rid, ()))
        self.steps += 1
        if now or self.steps >= self.interval:  # at the default interval of 1: every step
            self.flush()

    def flush(self) -> None:
        """Sends whatever is gathered."""
        if self.opened or self.deltas:
            self.send(TokenBatch(opened=self.opened, deltas=list(self.deltas.values())))
            self.opened, self.deltas = [], {}
        self.steps = 0


class OwnerRoutes:
    """With ``--detokenize-in api``: each request's tokens go to the api that owns it (its opening's
    ``reply_to``; "" is the configured api), in one frame per api and batch."""

    def __init__(self, outboxes: ReplyOutboxes) -> None:
        self.outboxes = outboxes
        self.owner: dict[str, str] = {}  # rid -> reply_to, from its opening until its release

    def send(self, batch: TokenBatch) -> None:
        for opened in batch.opened:
            self.owner[opened.rid] = opened.reply_to
        owners = {self.owner.get(d.rid, "") for d in batch.deltas} | {o.reply_to for o in batch.opened}
        if len(owners) == 1:  # one api: the whole batch, as it is
            self.outboxes.send(owners.pop(), batch)
            return
        for owner in owners:
            opened = [o for o in batch.opened if o.reply_to == owner]
            self.outboxes.send(owner, TokenBatch(opened=opened, deltas=[d for d in batch.deltas if self.owner.get(d.rid, "") == owner]))

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self.owner.pop(rid, None)
