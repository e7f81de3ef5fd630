"""Speculative decoding with a draft model (``--speculative-method draft``) changes no greedy output of llama, qwen3,
qwen3_moe and qwen3_next targets: a second tiny checkpoint of the same vocabulary, or the target itself, proposes;
under chunked prefill, mixed batches, preemption and aborts the outputs are transformers' greedy continuation token
for token, and every target and draft block goes back to its pool. The target as its own draft proposes the
target's tokens, so nearly all are accepted: its KV is in step with the request's tokens through catch-ups, verifies
and recomputes."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import PreTrainedModel

from services.scheduler.core import Scheduler
from services.scheduler.draft_blocks import DraftBlocks
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.speculation import Speculation
from services.scheduler.state_slots import SlotPool
from services.worker.runner import ModelRunner, RunnerConfig
from services.worker.speculative import draft as draft_module
from shared.devtools.inprocess_engine import InProcessEngine
from shared.devtools.random_model import build_random_smollm
from shared.frames import SamplingParams, Submit
from shared.model_info import load_model_info
from tests.scheduler.pipelined_aborts import run_with_aborts
from tests.worker.harness import GREEDY, TINY_QWEN3_NEXTS, build_tiny

NEW_TOKENS = 20
BLOCK_SIZE = 4
PROMPTS = [
    [11, 12, 13, 14, 15, 16, 17, 18] * 2 + [11, 12],
    [5, 17, 33, 9, 81, 5, 17],
    [70, 71, 72, 73, 74, 75],
    [40, 41, 42, 11, 12, 13, 99, 98, 97, 96, 95],
    [90, 91, 92, 93, 90],
]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, tmp_path_factory):
    """The target, a draft of its first two layers (of three), the target's greedy continuations and the draft's model."""
    root = tmp_path_factory.mktemp(f"draft-{request.param}")
    reference = build_tiny(request.param, str(root / "target"))
    draft = layers_of(reference, 2)
    draft.save_pretrained(str(root / "draft"))
    expected = {}
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected[f"r{i}"] = out[0, len(prompt) :].tolist()
    return str(root / "target"), str(root / "draft"), expected, draft


def layers_of(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A checkpoint of ``model``'s first layers, with its embeddings, final norm and head: it agrees with it in part."""
    overrides: dict[str, object] = {"num_hidden_layers": num_layers}
    if getattr(model.config, "layer_types", None):
        overrides["layer_types"] = model.config.layer_types[:num_layers]
    draft = type(model)(type(model.config)(**{**model.config.to_dict(), **overrides})).eval()
    draft.load_state_dict(model.state_dict(), strict=False)
    return draft


def engine(target: str, draft: str, num_blocks: int, budget: int, depth: int, k: int, draft_blocks: int = 64, decode_plan_s: float = 0.0):
    """A scheduler and runner of 8 requests at most; a hybrid model's with its GDN state slots and the states its verifies roll back to."""
    hybrid = load_model_info(target).uses_state_slots
    config = RunnerConfig(
        target, num_blocks=num_blocks, block_size=BLOCK_SIZE, speculative_method="draft", draft_model=draft, draft_kv_blocks=draft_blocks, verify_states=8 * k
    )
    runner = ModelRunner(config)
    scheduler = Scheduler(
        BlockPool(num_blocks, BLOCK_SIZE),
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_waiting=100,
        decode_plan_s=decode_plan_s,
        speculation=Speculation(k, 8),
        draft_blocks=DraftBlocks(draft_blocks, BLOCK_SIZE),
        slots=SlotPool(8) if hybrid else None,
    )
    return InProcessEngine(scheduler, runner, depth), scheduler, runner


def submits() -> list[Submit]:
    return [
        Submit(rid=f"r{i}", prompt_ids=prompt, max_tokens=NEW_TOKENS - (i == 2), sampling=GREEDY, ignore_eos=True, min_tokens=3 if i == 1 else 0)
        for i, prompt in enumerate(PROMPTS)
    ]


def assert_all_given_back(scheduler: Scheduler, runner: ModelRunner) -> None:
    assert scheduler.pool.num_used == 0 and scheduler.draft_blocks.pool.num_used == 0
    scheduler.pool.check()
    scheduler.draft_blocks.pool.check()
    assert len(runner.requests) == 0


@pytest.mark.parametrize("own_draft", [True, False], ids=["target-as-draft", "two-layer-draft"])
@pytest.mark.parametrize(
    "num_blocks,budget,depth,k,draft_blocks,decode_plan_s",
    [
        (64, 256, 2, 3, 64, 0.0),  # whole prompts, then verifies in batches of decodes
        (64, 7, 2, 4, 64, 0.0),  # chunks of 7 tokens in the same steps as verifies; the draft catches up over them
        (14, 16, 1, 3, 64, 1.0),  # 56 KV slots for 5 requests of up to 38 tokens: preemption, recompute; plain runs
        (64, 256, 2, 3, 9, 0.0),  # a draft pool too small for all: who finds no draft block decodes plainly
    ],
)
def test_greedy_outputs_equal_transformers_with_a_draft_model(
    models, own_draft: bool, num_blocks: int, budget: int, depth: int, k: int, draft_blocks: int, decode_plan_s: float
) -> None:
    target, small, expected, _ = models
    run_engine, scheduler, runner = engine(target, target if own_draft else small, num_blocks, budget, depth, k, draft_blocks, decode_plan_s)
    work = submits()
    result = run_engine.run(work[:3], arrivals={3: work[3:4], 6: work[4:]})
    assert result.outputs == {**expected, "r2": expected["r2"][: NEW_TOKENS - 1]}
    spec = runner.speculator
    assert spec.drafts > 0
    if own_draft:  # the draft's KV follows the request's tokens: it proposes what the target computes
        assert spec.accepted_tokens >= 0.95 * spec.draft_tokens, spec.describe()
    assert_all_given_back(scheduler, runner)
    if num_blocks == 14:
        assert scheduler.num_preemptions > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_moe_and_hybrid_targets_give_their_greedy_outputs_with_a_draft_model(tmp_path: Path, family: str) -> None:
    """A MoE target as its own draft; a hybrid target with a llama draft of its vocabulary (a draft holds KV alone),
    whose rejected proposals roll the target's GDN state back; under chunked prefill and preemption."""
    reference = build_tiny(family, str(tmp_path / "target"), **(TINY_QWEN3_NEXTS["gqa-dense-layer"] if family == "qwen3_next" else {}))
    draft = str(tmp_path / "target")
    if family == "qwen3_next":
        draft = str(tmp_path / "draft")
        build_tiny("llama", draft)
    run_engine, scheduler, runner = engine(str(tmp_path / "target"), draft, 14, 7, 2, 3)
    result = run_engine.run(submits())
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert result.outputs[f"r{i}"] == out[0, len(prompt) :].tolist()[: NEW_TOKENS - (i == 2)]
    spec = runner.speculator
    assert spec.drafts > 0 and scheduler.num_preemptions > 0
    if family == "qwen3_moe":
        assert spec.accepted_tokens >= 0.95 * spec.draft_tokens, spec.describe()
    assert_all_given_back(scheduler, runner)


@pytest.mark.parametrize("catch_up", [draft_module.CATCH_UP_TOKENS, 5], ids=["whole-catch-up", "catch-up-in-pieces"])
def test_each_proposal_is_the_draft_checkpoints_own_greedy_continuation(models, monkeypatch, catch_up: int) -> None:
    """The draft's KV is in step with each request's tokens: every proposal equals transformers' greedy continuation
    of the draft checkpoint over the request's tokens so far, after verifies that accepted all, some or none of
    its proposals, over chunked prefill and recomputes after preemption, and with catch-ups in pieces."""
    monkeypatch.setattr(draft_module, "CATCH_UP_TOKENS", catch_up)
    target, small, _, draft = models
    run_engine, scheduler, runner = engine(target, small, 14, 7, 2, 3)
    proposer = runner.speculator.proposer
    extend, propose = proposer.extend, proposer.propose
    tokens: dict[str, list[int]] = {}
    checked = []

    def extend_recorded(rid: str, token_ids: list[int]) -> None:
        tokens.setdefault(rid, []).extend(token_ids)
        extend(rid, token_ids)

    def propose_checked(wanted: dict[str, int]) -> dict[str, list[int]]:
        proposals = propose(wanted)
        for rid, proposal in proposals.items():
            with torch.no_grad():
                out = draft.generate(torch.tensor([tokens[rid]]), max_new_tokens=len(proposal), do_sample=False, eos_token_id=None, pad_token_id=0)
            assert proposal == out[0, len(tokens[rid]) :].tolist(), (rid, len(tokens[rid]))
            checked.append(proposal)
        return proposals

    proposer.extend, proposer.propose = extend_recorded, propose_checked
    runner.release = lambda rids, release=runner.release: ([tokens.pop(rid, None) for rid in rids], release(rids))
    run_engine.run(submits())
    spec = runner.speculator
    assert len(checked) == spec.drafts > 10 and 0 < spec.accepted_tokens < spec.draft_tokens and scheduler.num_preemptions > 0
    assert_all_given_back(scheduler, runner)


def test_aborts_while_verifies_are_in_flight_free_every_draft_block(models) -> None:
    target, small, expected, _ = models
    run_engine, scheduler, runner = engine(target, small, 64, 256, 2, 3)
    outputs = run_with_aborts(run_engine, scheduler, runner, submits(), aborted=("r0", "r3"))
    for rid in ("r1", "r4"):
        assert outputs[rid] == expected[rid]
    for rid in ("r0", "r3"):
        assert outputs.get(rid, []) == expected[rid][: len(outputs.get(rid, []))]
    assert_all_given_back(scheduler, runner)


def test_seeded_sampled_requests_with_the_target_as_draft_accept_and_repeat_themselves(models) -> None:
    """Sampled requests draw their proposals from the draft's distribution q, which the rejection sampler divides
    by: with the target as its own draft q equals the target's p, so almost every proposal is accepted, and with a
    seed each request's tokens are the same from run to run."""
    target, _, _, _ = models
    work = [
        msgspec.structs.replace(s, sampling=SamplingParams(temperature=0.8 if i % 2 else 1.0, top_p=0.95, seed=100 + i), max_tokens=NEW_TOKENS)
        for i, s in enumerate(submits())
    ]
    outputs = []
    for _ in range(2):
        run_engine, scheduler, runner = engine(target, target, 64, 256, 2, 3)
        outputs.append(run_engine.run(work).outputs)
        spec = runner.speculator
        assert spec.accepted_tokens >= 0.9 * spec.draft_tokens, spec.describe()
        assert_all_given_back(scheduler, runner)
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == NEW_TOKENS for tokens in outputs[0].values())


def test_a_draft_of_another_vocabulary_is_refused_at_start(tmp_path: Path) -> None:
    build_tiny("llama", str(tmp_path / "target"))
    build_tiny("llama", str(tmp_path / "draft"), vocab_size=128)
    config = RunnerConfig(str(tmp_path / "target"), num_blocks=16, block_size=BLOCK_SIZE, speculative_method="draft", draft_model=str(tmp_path / "draft"))
    with pytest.raises(ValueError, match="has a vocabulary of 128 tokens but the model 256: a draft must share the model's tokenizer"):
        ModelRunner(config)
    with pytest.raises(ValueError, match="needs --draft-model"):
        ModelRunner(dataclasses.replace(config, draft_model=""))


def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused_at_start(tmp_path: Path) -> None:
    target = build_random_smollm(str(tmp_path / "target"))
    draft = tmp_path / "draft"  # the model's config and tokenizer files: a draft's tokenizer is checked before its weights load
    draft.mkdir()
    for name in os.listdir(target):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(target, name), draft)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = RunnerConfig(target, num_blocks=16, block_size=BLOCK_SIZE, speculative_method="draft", draft_model=str(draft))
    with pytest.raises(ValueError, match="does not share the model's tokenizer: 2 tokens have other ids or are missing"):
        ModelRunner(config)
