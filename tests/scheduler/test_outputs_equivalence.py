"""Greedy outputs do not depend on scheduling: prefix cache on or off, any chunk size, forced preemption.

A tiny random Llama runs through the real scheduler state machine and ModelRunner (the
pipelined protocol, in one process); every configuration must reproduce transformers'
greedy continuation exactly.
"""

from __future__ import annotations

import pytest
import torch

from services.scheduler.core import Scheduler
from services.scheduler.kv_blocks import BlockPool
from services.worker.runner import ModelRunner, RunnerConfig
from shared.devtools.inprocess_engine import InProcessEngine
from shared.frames import SamplingParams, Submit
from tests.worker.harness import build_tiny_llama

NEW_TOKENS = 16
SHARED = [5, 17, 33, 9, 81, 4, 99, 12, 7, 64, 3, 28, 45, 11, 90, 21, 8]  # a common "system prompt"
PROMPTS = [SHARED + [40, 41, 42], SHARED + [50], SHARED[:9] + [60, 61, 62, 63, 64, 65], [70, 71, 72, 73, 74], SHARED + [40, 41, 42, 43]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-llama-sched"))
    reference = build_tiny_llama(path)
    expected = {}
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected[f"r{i}"] = out[0, len(prompt) :].tolist()
    return path, expected


def run(path: str, num_blocks: int, budget: int, prefix_cache: bool, depth: int = 2, decode_plan_s: float = 0.0, stop: int | None = None):
    block_size = 4
    runner = ModelRunner(RunnerConfig(path, num_blocks=num_blocks, block_size=block_size))
    scheduler = Scheduler(
        BlockPool(num_blocks, block_size, prefix_cache), max_num_seqs=8, max_num_batched_tokens=budget, max_waiting=100, decode_plan_s=decode_plan_s
    )
    submits = [
        Submit(
            rid=f"r{i}",
            prompt_ids=prompt,
            max_tokens=NEW_TOKENS,
            sampling=SamplingParams(temperature=0),
            ignore_eos=stop is None,
            stop_token_ids=[] if stop is None else [stop],
            min_tokens=3 if i == 1 else 0,
        )
        for i, prompt in enumerate(PROMPTS)
    ]
    # The last two arrive later, while the others decode, so they can hit the cache of scheduled blocks.
    result = InProcessEngine(scheduler, runner, depth).run(submits[:3], arrivals={3: submits[3:4], 6: submits[4:]})
    assert scheduler.pool.num_used == 0
    return result, scheduler


@pytest.mark.parametrize(
    "num_blocks,budget,prefix_cache,depth,decode_plan_s",
    [
        (64, 256, False, 2, 0.0),  # no chunking, no cache
        (64, 256, True, 2, 0.0),  # prefix cache
        (64, 7, True, 2, 0.0),  # chunks of 7 tokens mixed with decodes
        (64, 3, False, 1, 0.0),  # tiny chunks, strictly alternating steps
        (64, 5, True, 1, 0.0),
        (12, 16, True, 2, 0.0),  # 48 KV slots for 5 requests of up to 37 tokens: preemption and recompute
        (12, 16, False, 2, 0.0),
        (64, 256, True, 2, 1.0),  # plans of decodes alone run up to MAX_DECODE_STEPS steps
        (64, 7, True, 1, 1.0),
        (12, 16, False, 2, 1.0),  # ... under preemption
    ],
)
def test_greedy_outputs_match_transformers(model, num_blocks: int, budget: int, prefix_cache: bool, depth: int, decode_plan_s: float) -> None:
    path, expected = model
    result, scheduler = run(path, num_blocks, budget, prefix_cache, depth, decode_plan_s)
    assert result.outputs == expected
    if decode_plan_s:
        assert scheduler.decode_runs.steps() > 1 and result.steps < 60, "plans of several decode steps were meant to run"
    if prefix_cache and num_blocks == 64:
        assert result.cached_tokens.get("r4", 0) >= 16, "the late request with the shared prefix should reuse it"
    if num_blocks == 12:
        assert scheduler.num_preemptions > 0, "the tiny pool was meant to force preemption"


@pytest.mark.parametrize("decode_plan_s", [0.0, 1.0])
def test_a_stop_token_ends_each_request_where_the_reference_continuation_has_it(model, decode_plan_s: float) -> None:
    path, expected = model
    stop = expected["r0"][5]
    result, _ = run(path, 64, 256, True, 2, decode_plan_s, stop=stop)
    for rid, tokens in expected.items():
        min_tokens = 3 if rid == "r1" else 0
        ends = [i for i, t in enumerate(tokens) if t == stop and i + 1 >= min_tokens]
        assert result.outputs[rid] == tokens[: ends[0] + 1 if ends else None]
        assert result.finish[rid] == ("stop" if ends else "length")


def test_running_streams_keep_decoding_while_a_long_prompt_prefills(tmp_path) -> None:
    path = str(tmp_path / "tiny")
    build_tiny_llama(path, max_position_embeddings=4096)
    runner = ModelRunner(RunnerConfig(path, num_blocks=1024, block_size=16))
    scheduler = Scheduler(BlockPool(1024, 16), max_num_seqs=16, max_num_batched_tokens=256, max_waiting=100)
    streams = [Submit(rid=f"s{i}", prompt_ids=[10 + i, 20, 30], max_tokens=40, sampling=SamplingParams(temperature=0), ignore_eos=True) for i in range(8)]
    long_prompt = Submit(rid="long", prompt_ids=[(7 * i) % 250 + 3 for i in range(2000)], max_tokens=2, sampling=SamplingParams(temperature=0), ignore_eos=True)
    result = InProcessEngine(scheduler, runner).run(streams, arrivals={4: [long_prompt]})
    first_long = result.token_steps["long"][0]
    assert first_long - 4 >= 2000 // 256, "the long prompt should take several chunked steps"
    for rid in (s.rid for s in streams):
        steps = result.token_steps[rid]
        during = [b - a for a, b in zip(steps, steps[1:]) if 4 <= a <= first_long]
        assert during and max(during) <= 2, f"{rid} stalled for {max(during)} steps during the long prefill"
