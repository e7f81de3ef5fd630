"""The worker's token stream: every step's tokens at once by default; with a stream interval, a request's
tokens gathered over steps into one delta, sent when the interval is full, at once for a step that samples
a request's first token (the end of its prefill) or a stop token, and on flush."""

from __future__ import annotations

from services.worker.token_stream import OwnerRoutes, TokenStream
from shared.frames import Sampled, Slice, StepPlan, StepResult, StreamOpen, TokenBatch, TokenDelta, TokenLogprobs

STOP = 2


def opening(rid: str) -> Slice:
    return Slice(rid, 0, 3, [5, 6, 7], opened=StreamOpen(rid=rid, reply_to="ipc://api", prompt_tokens=3, max_tokens=100))


def step(plan_slices: list[Slice], sampled: dict[str, int], logprobs: bool = False) -> tuple[StepPlan, StepResult]:
    tokens = [Sampled(rid, t, logprobs=TokenLogprobs(logprob=-0.5 - t) if logprobs else None) for rid, t in sampled.items()]
    return StepPlan(0, plan_slices), StepResult(step=0, sampled=tokens)


def decodes(*rids: str) -> list[Slice]:
    return [Slice(rid, 3, 1) for rid in rids]


def stream(interval: int) -> tuple[TokenStream, list[TokenBatch]]:
    sent: list[TokenBatch] = []
    return TokenStream(sent.append, interval, {"a": frozenset({STOP}), "b": frozenset({STOP})}), sent


def tokens_of(batch: TokenBatch) -> dict[str, list[int]]:
    return {d.rid: d.token_ids for d in batch.deltas}


def test_interval_one_sends_every_step() -> None:
    tokens, sent = stream(1)
    tokens.add(*step([opening("a")], {"a": 10}))
    tokens.add(*step(decodes("a"), {"a": 11}))
    assert [(len(b.opened), tokens_of(b)) for b in sent] == [(1, {"a": [10]}), (0, {"a": [11]})]


def test_a_first_token_goes_at_once_and_later_ones_by_the_interval() -> None:
    tokens, sent = stream(3)
    tokens.add(*step([opening("a"), opening("b")], {"a": 10, "b": 20}))
    assert len(sent) == 1 and len(sent[0].opened) == 2 and tokens_of(sent[0]) == {"a": [10], "b": [20]}
    tokens.add(*step(decodes("a", "b"), {"a": 11, "b": 21}))
    tokens.add(*step(decodes("a", "b"), {"a": 12, "b": 22}))
    assert len(sent) == 1  # two steps gathered of three
    tokens.add(*step(decodes("a", "b"), {"a": 13, "b": 23}))
    assert len(sent) == 2 and tokens_of(sent[1]) == {"a": [11, 12, 13], "b": [21, 22, 23]} and not sent[1].opened


def test_a_stop_token_or_a_new_request_sends_what_is_gathered() -> None:
    tokens, sent = stream(8)
    tokens.add(*step([opening("a")], {"a": 10}))
    tokens.add(*step(decodes("a"), {"a": 11}))
    tokens.add(*step(decodes("a"), {"a": STOP}))
    assert tokens_of(sent[-1]) == {"a": [11, STOP]}
    tokens.add(*step(decodes("b"), {"b": 21}))
    tokens.add(*step([opening("c"), *decodes("b")], {"c": 30, "b": 22}))  # c's first token goes at once, with b's gathered
    assert tokens_of(sent[-1]) == {"b": [21, 22], "c": [30]} and [o.rid for o in sent[-1].opened] == ["c"]


def test_flush_sends_the_rest_with_logprobs_token_for_token_and_errors_send_nothing() -> None:
    tokens, sent = stream(4)
    tokens.add(*step(decodes("a"), {"a": 11}, logprobs=True))
    tokens.add(*step(decodes("a"), {"a": 12}, logprobs=True))
    tokens.add(StepPlan(0, decodes("a")), StepResult(step=0, sampled=[], error="boom"))
    tokens.flush()
    (batch,) = sent
    (delta,) = batch.deltas
    assert delta.token_ids == [11, 12] and [lp.logprob for lp in delta.logprobs] == [-11.5, -12.5]
    tokens.flush()
    assert len(sent) == 1  # nothing gathered: nothing sent


def test_a_prefill_over_several_steps_sends_its_opening_with_the_first_token() -> None:
    tokens, sent = stream(4)
    first_chunk = Slice("a", 0, 3, [5, 6, 7], opened=StreamOpen(rid="a", reply_to="ipc://api", prompt_tokens=6, max_tokens=100))
    tokens.add(StepPlan(0, [first_chunk]), StepResult(step=0, sampled=[]))  # samples nothing: no token yet
    assert sent == []
    tokens.add(*step([Slice("a", 3, 3, [8, 9, 10])], {"a": 10}))  # the last chunk samples the first token
    (batch,) = sent
    assert [o.rid for o in batch.opened] == ["a"] and tokens_of(batch) == {"a": [10]}


class _Outboxes:
    """Stands in for the worker's ReplyOutboxes: what each api address was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, TokenBatch]] = []

    def send(self, address: str, batch: TokenBatch) -> None:
        self.sent.append((address, batch))


def test_tokens_go_to_the_api_that_owns_each_request_until_it_is_released() -> None:
    outboxes = _Outboxes()
    routes = OwnerRoutes(outboxes)
    a, b = StreamOpen(rid="a", reply_to="ipc://api-a", prompt_tokens=3, max_tokens=9), StreamOpen(rid="b", reply_to="", prompt_tokens=3, max_tokens=9)
    first = TokenBatch(opened=[a], deltas=[TokenDelta("a", [5])])
    routes.send(first)
    assert outboxes.sent == [("ipc://api-a", first)]  # one api: the batch as it is
    routes.send(TokenBatch(opened=[b], deltas=[TokenDelta("a", [6]), TokenDelta("b", [7])]))
    split = {address: (batch.opened, tokens_of(batch)) for address, batch in outboxes.sent[1:]}
    assert split == {"ipc://api-a": ([], {"a": [6]}), "": ([b], {"b": [7]})}
    routes.release(["a"])
    assert routes.owner == {"b": ""}
