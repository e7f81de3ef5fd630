"""Garbage on the wire: random, truncated, oversized and wrong-type frames sent to every process's inbox are
counted and dropped; no process dies, and real traffic still completes."""

from __future__ import annotations

import json
import random
import time

import zmq

from shared.codec import encode
from shared.frames import Abort, EngineStatus, Release, SamplingParams, Slice, StepPlan, StepResult, Submit, TextBatch, TextDelta, TokenBatch
from tests.e2e.conftest import Stack, http_post, metric_value, wait_until_quiescent

_SUBMIT = Submit(rid="fuzz", prompt_ids=list(range(1, 40)), max_tokens=4, sampling=SamplingParams(), stop_token_ids=[2])
_PLAN = StepPlan(step=1, slices=[Slice(rid="fuzz", start=0, num_tokens=8, token_ids=list(range(1, 9)))])
# Frames each inbox never receives (the others flow elsewhere): they must be dropped, not acted on.
WRONG_TYPE = {
    "api": [_SUBMIT, _PLAN, StepResult(step=1, sampled=[])],
    "scheduler": [TextBatch(deltas=[TextDelta(rid="fuzz", text="x")]), _PLAN, EngineStatus(state="ready")],
    "worker": [_SUBMIT, TextBatch(deltas=[]), Abort(rid="fuzz")],
    "detokenizer": [_SUBMIT, _PLAN, StepResult(step=1, sampled=[])],
}
# Well-formed frames each inbox does receive, to truncate.
ACCEPTED = {
    "api": [TextBatch(deltas=[TextDelta(rid="fuzz", text="hello")]), TokenBatch(deltas=[])],
    "scheduler": [_SUBMIT],
    "worker": [_PLAN, Release(rids=["fuzz"])],
    "detokenizer": [TokenBatch(deltas=[])],
}


def _garbage(process: str, rng: random.Random) -> list[bytes]:
    frames = [rng.randbytes(rng.randrange(0, 300)) for _ in range(150)]
    for frame in ACCEPTED[process]:
        data = encode(frame)
        frames += [data[: rng.randrange(0, len(data))] for _ in range(30)]
    frames.append(rng.randbytes(4 * 1024 * 1024))  # oversized
    return frames


def _counter(text: str, name: str, socket: str) -> float:
    try:
        return metric_value(text, f'{name}{{socket="{socket}"}}')
    except KeyError:  # not counted yet
        return 0.0


def test_garbage_frames_are_counted_and_dropped_and_the_stack_keeps_serving(stack: Stack) -> None:
    rng = random.Random(8)
    facts = {name: stack.instrumentation(name) for name in stack.processes}
    before = {name: stack.metrics(name) for name in stack.processes}
    ctx = zmq.Context()
    sockets = []
    sent_garbage = {}
    for name in stack.processes:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(facts[name]["addresses"]["inbox"])
        garbage = _garbage(name, rng)
        decodable = [f for f in garbage if _decodes(f)]  # a random byte string can be a valid frame, rarely
        sent_garbage[name] = len(garbage) - len(decodable)
        for data in [f for f in garbage if not _decodes(f)] + [encode(f) for f in WRONG_TYPE[name]]:
            push.send(data)
        sockets.append(push)

    deadline = time.monotonic() + 20
    for name in stack.processes:
        inbox = f"{name}_inbox"
        while True:
            after = stack.metrics(name)
            errors = _counter(after, "tokenyard:frame_decode_errors_total", inbox) - _counter(before[name], "tokenyard:frame_decode_errors_total", inbox)
            unexpected = _counter(after, "tokenyard:frames_unexpected_total", inbox) - _counter(before[name], "tokenyard:frames_unexpected_total", inbox)
            if (errors, unexpected) == (sent_garbage[name], len(WRONG_TYPE[name])) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert (errors, unexpected) == (sent_garbage[name], len(WRONG_TYPE[name])), name
    for push in sockets:
        push.close()
    ctx.term()

    assert {name: stack.instrumentation(name)["pid"] for name in stack.processes} == {name: facts[name]["pid"] for name in stack.processes}, (
        "a process restarted"
    )
    status, body = http_post(
        f"{stack.base_url}/v1/chat/completions",
        json.dumps(
            {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12, "temperature": 0}
        ).encode(),
    )
    assert status == 200 and "Paris" in json.loads(body)["choices"][0]["message"]["content"]
    wait_until_quiescent(stack, 5)


def _decodes(data: bytes) -> bool:
    from shared.codec import FrameDecodeError, decode

    try:
        decode(data)
    except FrameDecodeError:
        return False
    return True
