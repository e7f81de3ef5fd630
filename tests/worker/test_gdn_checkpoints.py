"""GDN state checkpoints of a hybrid model's prefix cache on the worker: a prefill chunk saves its state at the
positions its slice names, a new request resumes from a copy of one, and either way the state is bit for bit
that of a fresh prefill of the same prefix (conv and recurrent state), also after a checkpoint is evicted and
made again and after a preemption; through the scheduler, greedy outputs are the same with the cache and without."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.core import Scheduler
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.state_slots import CheckpointPool, SlotPool
from services.worker.runner import ModelRunner, RunnerConfig
from shared.config import StackConfig
from shared.devtools.inprocess_engine import InProcessEngine
from shared.frames import Slice, StepPlan, Submit
from shared.model_info import gdn_checkpoints, load_model_info

from .harness import GREEDY, Checkpoint, prompt_of, reference_greedy

pytestmark = pytest.mark.usefixtures("one_thread")


def runner_for(tiny: Checkpoint, checkpoints: int = 4, num_blocks: int = 64) -> ModelRunner:
    return ModelRunner(RunnerConfig(tiny.path, num_blocks=num_blocks, block_size=4, max_num_seqs=3, gdn_checkpoint_slots=checkpoints))


def state_of(runner: ModelRunner, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot ``index``'s conv and recurrent state, every GDN layer's (a copy)."""
    return runner.states.conv_tensor[:, index].clone(), runner.states.recurrent_tensor[:, index].clone()


def checkpoint_state(runner: ModelRunner, checkpoint: int) -> tuple[torch.Tensor, torch.Tensor]:
    return state_of(runner, runner.states.checkpoint_base + checkpoint)


def assert_same_bits(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert ours[0].abs().sum() > 0 and ours[1].abs().sum() > 0, "a state that was never written"
    assert torch.equal(ours[0], theirs[0]), "conv state differs"
    assert torch.equal(ours[1], theirs[1]), "recurrent state differs"


def prefill(runner: ModelRunner, rid: str, tokens: list[int], start: int, blocks: list[int], slot: int, **kw) -> torch.Tensor:
    """One prefill chunk of ``tokens[start:]``; returns its last position's logits."""
    chunk = Slice(rid, start, len(tokens) - start, tokens[start:], blocks, sampling=GREEDY, slot=slot, **kw)
    return runner.logits(StepPlan(0, [chunk]))[rid]


PROMPT = prompt_of(3, 40)


def test_a_checkpoint_holds_the_state_of_a_fresh_prefill_of_its_prefix_and_a_restore_resumes_it_bit_for_bit(tiny_qwen3_next: Checkpoint) -> None:
    runner = runner_for(tiny_qwen3_next)
    prefill(runner, "a", PROMPT, 0, list(range(10)), slot=0, checkpoints=[(16, 0), (32, 1)])  # saved on the way through one chunk
    # A fresh prefill of the 32-token prefix, cut where a's chunk saved (at 16), saving at its end.
    prefill(runner, "fresh", PROMPT[:32], 0, list(range(10, 18)), slot=1, checkpoints=[(16, 2), (32, 3)])
    assert_same_bits(checkpoint_state(runner, 1), state_of(runner, 1))
    assert_same_bits(checkpoint_state(runner, 0), checkpoint_state(runner, 2))
    assert_same_bits(checkpoint_state(runner, 3), state_of(runner, 1))
    # b resumes from the checkpoint over fresh's KV blocks while fresh goes on past 32: the same state and logits, bit for bit.
    resumed = prefill(runner, "b", PROMPT, 32, [*range(10, 18), 20, 21], slot=2, restore=3)
    continued = prefill(runner, "fresh", PROMPT, 32, [18, 19], slot=1)
    assert_same_bits(state_of(runner, 2), state_of(runner, 1))
    assert torch.equal(resumed, continued)


def test_an_evicted_checkpoint_made_again_holds_the_same_bits(tiny_qwen3_next: Checkpoint) -> None:
    runner = runner_for(tiny_qwen3_next)
    prefill(runner, "a", PROMPT, 0, list(range(10)), slot=0, checkpoints=[(16, 0), (32, 1)])
    first = checkpoint_state(runner, 1)
    runner.release(["a"])
    prefill(runner, "other", prompt_of(4, 36), 0, list(range(10)), slot=0, checkpoints=[(32, 1)])  # its blocks and slot go to another prefix
    assert not torch.equal(checkpoint_state(runner, 1)[1], first[1])
    runner.release(["other"])
    prefill(runner, "again", PROMPT, 0, list(range(10, 20)), slot=2, checkpoints=[(16, 3), (32, 1)])  # made again from scratch
    assert_same_bits(checkpoint_state(runner, 1), first)


def test_restores_and_saves_are_checked_before_any_state_changes(tiny_qwen3_next: Checkpoint) -> None:
    runner = runner_for(tiny_qwen3_next, checkpoints=2)
    prefill(runner, "a", PROMPT[:8], 0, [0, 1], slot=0, checkpoints=[(4, 0)])
    bad = {
        "restore outside": Slice("b", 4, 2, [5, 6], [2], slot=1, restore=2),
        "restore at 0": Slice("b", 0, 2, [5, 6], [2], slot=1, restore=0),
        "restore mid-request": Slice("a", 8, 2, [5, 6], [2], slot=0, restore=0),
        "save outside the chunk": Slice("b", 0, 4, [5, 6, 7, 8], [2], slot=1, checkpoints=[(5, 1)]),
        "save in no checkpoint": Slice("b", 0, 4, [5, 6, 7, 8], [2], slot=1, checkpoints=[(4, 2)]),
        "saves out of order": Slice("b", 0, 4, [5, 6, 7, 8], [2], slot=1, checkpoints=[(4, 1), (2, 0)]),
    }
    before = runner.states.conv_tensor.clone(), runner.states.recurrent_tensor.clone()
    for case, chunk in bad.items():
        with pytest.raises(ValueError, match="GDN"):
            runner.execute(StepPlan(1, [chunk]))
        assert torch.equal(runner.states.conv_tensor, before[0]) and torch.equal(runner.states.recurrent_tensor, before[1]), case


def engine(tiny: Checkpoint, cache: bool, num_blocks: int = 128, budget: int = 64, interval: int = 16) -> InProcessEngine:
    runner = ModelRunner(RunnerConfig(tiny.path, num_blocks=num_blocks, block_size=4, max_num_seqs=4, gdn_checkpoint_slots=8 if cache else 0))
    checkpoints = CheckpointPool(8) if cache else None
    scheduler = Scheduler(BlockPool(num_blocks, 4, cache), 4, budget, 100, SlotPool(4), checkpoints=checkpoints, checkpoint_interval=interval)
    return InProcessEngine(scheduler, runner)


def test_a_multi_turn_conversation_gives_the_same_greedy_outputs_with_the_cache_resuming_at_its_anchors(tiny_qwen3_next: Checkpoint) -> None:
    system, user1, user2, edited = prompt_of(10, 21), prompt_of(11, 9), prompt_of(12, 7), prompt_of(13, 6)
    outputs: dict[bool, list[list[int]]] = {}
    cached: dict[bool, list[int]] = {}
    for cache in (False, True):
        e = engine(tiny_qwen3_next, cache)
        turn1 = system + user1
        r1 = e.run([Submit(rid="t1", prompt_ids=turn1, max_tokens=6, sampling=GREEDY, ignore_eos=True, anchors=[21, 30])])
        answer1 = r1.outputs["t1"]
        turn2 = turn1 + answer1 + user2  # the history as a template renders it: turn 1, its answer, a new message
        anchors2 = [21, 30, 36, 43]
        r2 = e.run([Submit(rid="t2", prompt_ids=turn2, max_tokens=6, sampling=GREEDY, ignore_eos=True, anchors=anchors2)])
        turn3 = turn1 + answer1 + edited  # turn 2's last user message edited
        r3 = e.run([Submit(rid="t3", prompt_ids=turn3, max_tokens=6, sampling=GREEDY, ignore_eos=True, anchors=[21, 30, 36, 42])])
        outputs[cache] = [answer1, r2.outputs["t2"], r3.outputs["t3"]]
        cached[cache] = [r.cached_tokens.get(rid, 0) for r, rid in ((r1, "t1"), (r2, "t2"), (r3, "t3"))]
    assert outputs[True] == outputs[False]
    assert outputs[False][1] == reference_greedy(tiny_qwen3_next.reference, system + user1 + outputs[False][0] + user2, 6)
    # turn 2 recomputes from turn 1's prompt end (30 → the block at 28), turn 3 from the end of turn 1's answer (36)
    assert cached[False] == [0, 0, 0] and cached[True] == [0, 28, 36]


def test_a_request_preempted_after_its_checkpoints_resumes_from_them_with_the_same_outputs(tiny_qwen3_next: Checkpoint) -> None:
    prompts = {f"r{i}": prompt_of(20 + i, 24) for i in range(3)}
    outputs = {}
    for cache in (False, True):
        e = engine(tiny_qwen3_next, cache, num_blocks=24, budget=32, interval=8)  # 3 requests of 24 + 12 tokens need 27 blocks
        submits = [Submit(rid=rid, prompt_ids=p, max_tokens=12, sampling=GREEDY, ignore_eos=True) for rid, p in prompts.items()]
        outputs[cache] = e.run(submits).outputs
        assert e.scheduler.num_preemptions > 0
        if cache:
            assert e.scheduler.checkpoints.restored > 0, "a readmitted request was meant to resume from a checkpoint"
    assert outputs[True] == outputs[False]
    for rid, prompt in prompts.items():
        assert outputs[True][rid] == reference_greedy(tiny_qwen3_next.reference, prompt, 12), rid


def test_every_process_counts_a_checkpoints_bytes_as_the_worker_holds_them(tiny_qwen3_next: Checkpoint) -> None:
    runner = runner_for(tiny_qwen3_next, checkpoints=5)
    info = load_model_info(tiny_qwen3_next.path)
    assert info.gdn_state_bytes("float32") == runner.states.bytes_per_slot
    assert runner.states.checkpoint_bytes == 5 * info.gdn_state_bytes("float32")
    budget = 7 * info.gdn_state_bytes("float32") + 1  # a byte budget: the whole checkpoints it holds
    assert gdn_checkpoints(info, StackConfig(dtype="float32", gdn_checkpoint_bytes=budget)) == 7
    assert gdn_checkpoints(info, StackConfig(gdn_checkpoint_slots=9)) == 9
