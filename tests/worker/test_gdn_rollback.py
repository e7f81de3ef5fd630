"""A hybrid model's speculative verify leaves each request's GDN slot at the state after its last accepted token:
after a verify that accepts none, some or all of its proposed tokens, in a step beside a prefill chunk and a plain
decode of other requests, the slot holds what plain decoding of the same tokens leaves, and the request goes on
with the same tokens."""

from __future__ import annotations

import pytest
import torch

from services.worker.runner import ModelRunner, RunnerConfig
from shared.frames import Slice, StepPlan

from .harness import GREEDY, Checkpoint, prompt_of

pytestmark = pytest.mark.usefixtures("one_thread")

K = 4
BLOCK = 4


class FixedProposer:
    """Proposes what a test sets in ``next`` for a request, once."""

    def __init__(self) -> None:
        self.next: dict[str, list[int]] = {}

    def extend(self, rid: str, token_ids: list[int]) -> None:
        pass

    def propose(self, wanted: dict[str, int]) -> dict[str, list[int]]:
        return {rid: self.next.pop(rid)[:count] for rid, count in wanted.items() if rid in self.next}

    def release(self, rid: str) -> None:
        self.next.pop(rid, None)


class Driver:
    """Slices for one runner, each request's blocks handed out from its own range as its positions need them."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.step, self.first_block = runner, 0, {}

    def new_blocks(self, rid: str, end: int) -> list[int]:
        held = len(self.runner.requests[rid].table) if rid in self.runner.requests else 0
        base = self.first_block.setdefault(rid, 16 * len(self.first_block))
        return list(range(base + held, base + -(-end // BLOCK)))

    def prefill(self, rid: str, prompt: list[int], slot: int) -> Slice:
        return Slice(rid, 0, len(prompt), prompt, self.new_blocks(rid, len(prompt)), sampling=GREEDY, slot=slot)

    def decode(self, rid: str, position: int, slot: int, draft: int = 0) -> Slice:
        return Slice(rid, position, 1 + draft, new_blocks=self.new_blocks(rid, position + 1 + draft), slot=slot)

    def run(self, *slices: Slice) -> dict[str, list[int]]:
        self.step += 1
        out: dict[str, list[int]] = {}
        for x in self.runner.execute(StepPlan(self.step, list(slices))).sampled:
            out.setdefault(x.rid, []).append(x.token_id)
        return out


def slot_state(runner: ModelRunner, slot: int) -> list[torch.Tensor]:
    return [runner.states.conv_tensor[:, slot].clone(), runner.states.recurrent_tensor[:, slot].clone()]


@pytest.fixture(scope="module")
def reference(tiny_qwen3_nexts: dict[str, Checkpoint]) -> tuple[str, list[int], list[int], list[list[torch.Tensor]]]:
    """A prompt's greedy tokens decoded plainly, and its slot's state after each decode (``states[j]``: after the
    prompt and its first ``j + 1`` sampled tokens went through the model)."""
    path = tiny_qwen3_nexts["gqa-dense-layer"].path
    prompt = prompt_of(3, 13)
    runner = ModelRunner(RunnerConfig(path, num_blocks=64, block_size=BLOCK, max_num_seqs=4))
    drive = Driver(runner)
    tokens = drive.run(drive.prefill("r", prompt, slot=1))["r"]
    states = []
    for j in range(K + 2):
        tokens += drive.run(drive.decode("r", len(prompt) + j, slot=1))["r"]
        states.append(slot_state(runner, 1))
    return path, prompt, tokens, states


@pytest.mark.parametrize("accepted", [0, 2, K])
def test_a_verify_leaves_the_slot_at_the_state_after_its_last_accepted_token(reference, accepted: int) -> None:
    path, prompt, tokens, states = reference
    runner = ModelRunner(RunnerConfig(path, num_blocks=64, block_size=BLOCK, max_num_seqs=4, speculative_method="ngram", verify_states=K))
    proposer = runner.speculator.proposer = FixedProposer()
    drive = Driver(runner)
    first = drive.run(drive.prefill("spec", prompt, slot=1), drive.prefill("decoding", prompt_of(4, 6), slot=0))
    assert first["spec"] == tokens[:1]
    # The proposal: the first ``accepted`` tokens right, the rest wrong.
    proposer.next["spec"] = tokens[1 : 1 + accepted] + [(t + 1) % 256 for t in tokens[1 + accepted : 1 + K]]
    n = len(prompt)
    step = drive.run(drive.decode("spec", n, slot=1, draft=K), drive.decode("decoding", 6, slot=0), drive.prefill("prefilling", prompt_of(5, 9), slot=3))
    assert step["spec"] == tokens[1 : 2 + accepted]  # the accepted tokens, then the target's own
    assert runner.requests["spec"].end == n + 1 + accepted
    for ours, theirs in zip(slot_state(runner, 1), states[accepted]):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    # The next decode continues from there, beside the others' decodes.
    after = drive.run(drive.decode("spec", n + 1 + accepted, slot=1), drive.decode("decoding", 7, slot=0), drive.decode("prefilling", 9, slot=3))
    assert after["spec"] == [tokens[2 + accepted]]
    for ours, theirs in zip(slot_state(runner, 1), states[accepted + 1]):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_verifies_of_different_lengths_in_one_step_each_roll_back_to_their_own_token(reference) -> None:
    path, prompt, tokens, states = reference
    runner = ModelRunner(RunnerConfig(path, num_blocks=64, block_size=BLOCK, max_num_seqs=4, speculative_method="ngram", verify_states=2 * K))
    proposer = runner.speculator.proposer = FixedProposer()
    drive = Driver(runner)
    drive.run(drive.prefill("a", prompt, slot=2), drive.prefill("b", prompt, slot=0))
    proposer.next = {"a": tokens[1:3] + [0, 0], "b": tokens[1:2]}  # a: 2 of 4 accepted; b: its only one
    n = len(prompt)
    step = drive.run(drive.decode("a", n, slot=2, draft=K), drive.decode("b", n, slot=0, draft=K))
    assert step == {"a": tokens[1:4], "b": tokens[1:3]}
    for slot, accepted in ((2, 2), (0, 1)):
        for ours, theirs in zip(slot_state(runner, slot), states[accepted]):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_a_step_verifying_more_than_the_pool_keeps_is_refused_untouched(reference) -> None:
    path, prompt, _, _ = reference
    runner = ModelRunner(RunnerConfig(path, num_blocks=64, block_size=BLOCK, max_num_seqs=4, speculative_method="ngram", verify_states=K - 1))
    drive = Driver(runner)
    drive.run(drive.prefill("a", prompt, slot=0))
    before = slot_state(runner, 0)
    with pytest.raises(ValueError, match="roll back"):
        drive.run(drive.decode("a", len(prompt), slot=0, draft=K))
    assert all(torch.equal(x, y) for x, y in zip(slot_state(runner, 0), before)) and runner.requests["a"].end == len(prompt)
    facts = runner.describe()["gdn_state"]
    assert facts["verify_states"] == K - 1 and facts["verify_state_bytes"] == (K - 1) * facts["bytes_per_slot"]
