"""Every frame type survives encode/decode, and garbage fails with a clear error."""

from __future__ import annotations

import msgspec
import pytest

from shared.codec import FrameDecodeError, decode, encode
from shared.frames import (
    Abort,
    ApiAnnounce,
    CompileGrammar,
    EngineState,
    EngineStatus,
    Error,
    ErrorType,
    Finish,
    FinishReason,
    Frame,
    Grammar,
    GrammarCompiled,
    GrammarKind,
    Heartbeat,
    MemoryResized,
    MemorySplit,
    Process,
    ProcessState,
    Release,
    ResizeMemory,
    Sampled,
    SamplingParams,
    Slice,
    StepPlan,
    StepResult,
    StreamOpen,
    Submit,
    TextBatch,
    TextDelta,
    TextLogprobs,
    TokenBatch,
    TokenDelta,
    TokenLogprobs,
    TokenText,
)

EXAMPLES = [
    Submit(
        rid="r1",
        prompt_ids=[1, 2, 3],
        max_tokens=16,
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7),
        stop_token_ids=[2],
        stop=["\n\n"],
        ignore_eos=True,
        min_tokens=2,
        arrival_time=1.5,
        reply_to="ipc:///tmp/tokenyard/api-api-0.sock",
    ),
    Submit(rid="r2", prompt_ids=[5], max_tokens=1),
    Submit(
        rid="r3",
        prompt_ids=[5],
        max_tokens=1,
        sampling=SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2, logit_bias={7: -100.0, 9: 2.5}, logprobs=0),
    ),
    Submit(rid="r5", prompt_ids=[5, 6, 7, 8], max_tokens=2, anchors=[1, 3]),
    Abort(rid="r1"),
    CompileGrammar(rid="r6", grammar=Grammar(GrammarKind.JSON_SCHEMA, '{"type": "object"}', strict=True)),
    GrammarCompiled(rid="r6"),
    GrammarCompiled(rid="r7", error="unbalanced parenthesis"),
    StepPlan(
        step=9,
        slices=[
            Slice(rid="r1", start=0, num_tokens=3, token_ids=[1, 2, 3], new_blocks=[4], sample=True, sampling=SamplingParams(seed=1), slot=2),
            Slice(rid="r2", start=7, num_tokens=1),
            Slice(rid="r5", start=16, num_tokens=16, token_ids=list(range(16)), slot=1, restore=3, checkpoints=[(32, 4)]),
            Slice(rid="r6", start=20, num_tokens=4),  # a speculative verify
            Slice(
                rid="r4",
                start=8,
                num_tokens=2,
                token_ids=[5, 6],
                opened=StreamOpen(rid="r4", prompt_tokens=10, max_tokens=5, stop_token_ids=[2], cached_tokens=8),
            ),
            Slice(rid="r3", start=2, num_tokens=1, token_ids=[3], sampling=SamplingParams(frequency_penalty=1.0), prompt_len=3, prefix_ids=[1, 2]),
        ],
    ),
    Release(rids=["r1", "r2"]),
    StepResult(step=9, sampled=[Sampled(rid="r1", token_id=42)], forward_s=0.01),
    StepResult(step=10, sampled=[], error="boom"),
    StepResult(step=11, sampled=[Sampled(rid="r3", token_id=4, logprobs=TokenLogprobs(-0.25, [4, 1], [-0.25, -1.5]))]),
    TokenBatch(deltas=[TokenDelta(rid="r3", token_ids=[4], logprobs=[TokenLogprobs(0.0)])]),
    TextBatch(deltas=[TextDelta(rid="r3", text="\ufffd", logprobs=[TextLogprobs(TokenText("\ufffd", b"\xf0\x9f", -0.5), [TokenText("a", b"a", -1.0)])])]),
    TokenBatch(
        opened=[
            StreamOpen(rid="r1", prompt_tokens=3, max_tokens=4, stop_token_ids=[2, 7], min_tokens=1, stop=["x"], skip_special_tokens=False, reply_to="api-0")
        ],
        deltas=[TokenDelta(rid="r1", token_ids=[42]), TokenDelta(rid="r2", finish=FinishReason.ABORT)],
    ),
    TextBatch(deltas=[TextDelta(rid="r1", text="héllo 👋", completion_tokens=2, finish=FinishReason.STOP, prompt_tokens=3)]),
    Finish(rid="r1", matched="\n\n"),
    Error(rid="", status=503, message="engine gone", type=ErrorType.SERVER),
    Heartbeat(process=Process.WORKER, pid=123, state=ProcessState.LOADING, detail="weights", progress=0.5),
    Heartbeat(process=Process.WORKER, pid=123, state=ProcessState.READY, kv_blocks=64, memory=MemorySplit(kv_blocks=64, kv_block_bytes=16384, applying=True)),
    EngineStatus(state=EngineState.READY, running=2, waiting=1, kv_blocks_total=10, kv_blocks_used=3, engine="engine-1"),
    ApiAnnounce(replica="api-1", address="tcp://api-1:5550", engine="engine-0"),
    ResizeMemory(id="m1", kv_cache_bytes=1 << 20, reply_to="ipc:///tmp/api.sock"),
    MemoryResized(
        id="m1",
        split=MemorySplit(kv_blocks=64, kv_block_bytes=16384, expert_cache_bytes=1 << 16, expert_slots=8, expert_slot_bytes=3456, expert_top_k=2, experts=32),
    ),
    MemoryResized(id="m2", status=409, error="a memory resize is still applying"),
]


def test_examples_cover_every_frame_type() -> None:
    assert {type(f) for f in EXAMPLES} == set(Frame.__args__)


@pytest.mark.parametrize("frame", EXAMPLES, ids=lambda f: type(f).__name__)
def test_round_trip(frame: object) -> None:
    assert decode(encode(frame)) == frame


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"\x00\x01\x02",
        b"\x92\xa7Unknown\x01",
        msgspec.msgpack.encode(["Submit", "r1"]),
        msgspec.msgpack.encode(["StepPlan", "not-an-int", []]),
        msgspec.msgpack.encode({"a": 1}),
    ],
)
def test_garbage_raises_frame_decode_error(garbage: bytes) -> None:
    with pytest.raises(FrameDecodeError, match="bad frame"):
        decode(garbage)


def test_step_frames_do_not_grow_with_context() -> None:
    """A decode slice carries no tokens, so a step's size is independent of context length."""
    short = encode(StepPlan(step=1, slices=[Slice(rid="a" * 32, start=10, num_tokens=1)]))
    long = encode(StepPlan(step=1, slices=[Slice(rid="a" * 32, start=100_000, num_tokens=1)]))
    assert len(long) - len(short) <= 4


def test_closed_sets_travel_as_their_strings_and_other_strings_are_refused() -> None:
    """The enums' values are the wire's (and the OpenAI API's) strings; a value outside the set does not decode."""
    delta = TextDelta(rid="r", finish=FinishReason.LENGTH)
    assert msgspec.msgpack.decode(encode(TextBatch(deltas=[delta])))[1][0][:4] == ["r", "", 0, "length"]
    assert decode(encode(TextBatch(deltas=[delta]))).deltas[0].finish is FinishReason.LENGTH
    assert decode(encode(TokenBatch(deltas=[TokenDelta(rid="r", token_ids=[5])]))).deltas[0].finish is None
    with pytest.raises(FrameDecodeError, match="bad frame"):
        decode(msgspec.msgpack.encode(["Heartbeat", "worker", 1, "sleeping"]))
    with pytest.raises(FrameDecodeError, match="bad frame"):
        decode(msgspec.msgpack.encode(["Finish", "r", "done"]))
