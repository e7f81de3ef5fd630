"""Speculative decoding changes no greedy output: proposals verified in the step's batch, under chunked prefill,
mixed batches, preemption and aborts, give transformers' greedy continuation token for token, and every block goes
back to the pool.

A tiny random model rarely repeats itself, so prompt lookup's proposals are mostly rejected; to verify runs that
are accepted in full, in part and not at all, the runner's proposer is replaced by one that proposes the
reference continuation with every ``wrong_every``-th token wrong."""

from __future__ import annotations

import msgspec
import pytest
import torch
from prometheus_client import REGISTRY

from services.scheduler.core import Scheduler
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.speculation import Speculation
from services.scheduler.state_slots import SlotPool
from services.worker.runner import ModelRunner, RunnerConfig
from shared.devtools.inprocess_engine import InProcessEngine
from shared.frames import FinishReason, SamplingParams, StepResult, Submit
from shared.model_info import load_model_info
from tests.scheduler.pipelined_aborts import run_with_aborts
from tests.worker.harness import TINY_QWEN3_NEXTS, build_tiny

NEW_TOKENS = 20
LOOP = [11, 12, 13, 14, 15, 16, 17, 18]
# Prompts that repeat themselves, so prompt lookup proposes; a tiny random model also falls into loops of its own.
PROMPTS = [
    LOOP * 3 + [11, 12],
    [5, 17, 33, 9, 81] * 2 + [5, 17],
    [70, 71, 72, 73, 74, 75],
    LOOP * 2 + [40, 41, 42, 11, 12, 13],
    [90, 91, 92, 93, 90, 91, 92, 93, 90],
]


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe", "qwen3_next"])
def model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"tiny-{request.param}-spec"))
    reference = build_tiny(request.param, path, **(TINY_QWEN3_NEXTS["gqa-dense-layer"] if request.param == "qwen3_next" else {}))
    expected = {}
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected[f"r{i}"] = out[0, len(prompt) :].tolist()
    return path, expected


class ReferenceProposer:
    """Proposes each request's reference continuation after its tokens, every ``wrong_every``-th token made wrong."""

    def __init__(self, expected: dict[str, list[int]], wrong_every: int) -> None:
        self.prompts = {f"r{i}": len(prompt) for i, prompt in enumerate(PROMPTS)}
        self.expected, self.wrong_every = expected, wrong_every
        self.tokens: dict[str, list[int]] = {}
        self.proposed = 0

    def extend(self, rid: str, token_ids: list[int]) -> None:
        self.tokens.setdefault(rid, []).extend(token_ids)

    def propose(self, wanted: dict[str, int]) -> dict[str, list[int]]:
        out = {}
        for rid, count in wanted.items():
            done = len(self.tokens[rid]) - self.prompts[rid]
            proposal = []
            for token in self.expected[rid][done : done + count]:
                self.proposed += 1
                proposal.append((token + 1) % 256 if self.proposed % self.wrong_every == 0 else token)
            if proposal:
                out[rid] = proposal
        return out

    def release(self, rid: str) -> None:
        self.tokens.pop(rid, None)


def engine(path: str, num_blocks: int, budget: int, depth: int, k: int, max_batch: int = 8, decode_plan_s: float = 0.0, proposer=None):
    """A scheduler and runner of 8 requests at most; a hybrid model's with its GDN state slots and the states its verifies roll back to."""
    block_size = 4
    hybrid = load_model_info(path).uses_state_slots
    runner = ModelRunner(
        RunnerConfig(path, num_blocks=num_blocks, block_size=block_size, speculative_method="ngram" if k else "", ngram=(1, 3), verify_states=max_batch * k)
    )
    if proposer is not None:
        runner.speculator.proposer = proposer
    scheduler = Scheduler(
        BlockPool(num_blocks, block_size),
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_waiting=100,
        decode_plan_s=decode_plan_s,
        speculation=Speculation(k, max_batch) if k else None,
        slots=SlotPool(8) if hybrid else None,
    )
    return InProcessEngine(scheduler, runner, depth), scheduler, runner


def submits(stop: int | None = None) -> list[Submit]:
    return [
        Submit(
            rid=f"r{i}",
            prompt_ids=prompt,
            max_tokens=NEW_TOKENS - (i == 2),  # one ends where a run of accepted tokens may overshoot it
            sampling=SamplingParams(temperature=0),
            ignore_eos=stop is None,
            stop_token_ids=[] if stop is None else [stop],
            min_tokens=3 if i == 1 else 0,
        )
        for i, prompt in enumerate(PROMPTS)
    ]


@pytest.mark.parametrize(
    "num_blocks,budget,depth,k,wrong_every,decode_plan_s",
    [
        (64, 256, 2, 3, 1000, 0.0),  # whole prompts, then verifies accepted in full, in batches of decodes
        (64, 256, 2, 3, 1, 0.0),  # every proposal rejected at once
        (64, 7, 2, 4, 3, 0.0),  # chunks of 7 tokens in the same steps as verifies accepted in part
        (64, 5, 1, 2, 2, 1.0),  # strictly alternating plans; runs of decodes where nothing speculates
        (14, 16, 2, 3, 3, 0.0),  # 56 KV slots for 5 requests of up to 46 tokens: preemption and recompute
    ],
)
def test_greedy_outputs_equal_transformers_with_speculation(
    model, num_blocks: int, budget: int, depth: int, k: int, wrong_every: int, decode_plan_s: float
) -> None:
    path, expected = model
    run_engine, scheduler, runner = engine(path, num_blocks, budget, depth, k, decode_plan_s=decode_plan_s, proposer=ReferenceProposer(expected, wrong_every))
    work = submits()
    result = run_engine.run(work[:3], arrivals={3: work[3:4], 6: work[4:]})
    assert result.outputs == {**expected, "r2": expected["r2"][: NEW_TOKENS - 1]}
    spec = runner.speculator
    assert spec.drafts > 0 and (spec.accepted_tokens == 0 if wrong_every == 1 else spec.accepted_tokens > 0)
    if wrong_every == 1000:
        assert spec.accepted_tokens == spec.draft_tokens
    assert scheduler.pool.num_used == 0
    scheduler.pool.check()
    if num_blocks == 14:
        assert scheduler.num_preemptions > 0


def recorded_steps(run_engine: InProcessEngine) -> list[tuple[dict[str, int], StepResult]]:
    """Each step the engine's worker runs from now on: its speculative slices' drafts by rid, and its result."""
    steps: list[tuple[dict[str, int], StepResult]] = []
    execute = run_engine.plan_runs.execute

    def recording(plan):
        result = execute(plan)
        steps.append(({s.rid: s.num_tokens - 1 for s in plan.slices if not s.token_ids and s.num_tokens > 1}, result))
        return result

    run_engine.plan_runs.execute = recording
    return steps


def test_prompt_lookup_changes_no_output_and_is_planned_a_verify_only_where_it_has_a_guess(tmp_path) -> None:
    """Over a vocabulary of 32 a tiny model repeats itself enough for prompt lookup to propose. The results say
    after which tokens it found no n-gram; those requests decode plainly, so every verify planned has a proposal."""
    reference = build_tiny("llama", str(tmp_path), vocab_size=32)
    prompts = [[t % 32 for t in prompt] for prompt in PROMPTS]
    run_engine, scheduler, runner = engine(str(tmp_path), 64, 7, 2, 3)
    steps = recorded_steps(run_engine)
    work = [msgspec.structs.replace(s, prompt_ids=prompt) for s, prompt in zip(submits(), prompts)]
    result = run_engine.run(work)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert result.outputs[f"r{i}"] == out[0, len(prompt) :].tolist()[: work[i].max_tokens]
    assert runner.speculator.drafts > 0
    assert scheduler.pool.num_used == 0
    assert any(step_result.no_guess for _, step_result in steps)
    for drafts, step_result in steps:
        assert all(step_result.proposed[rid] > 0 for rid in drafts)


def test_the_worker_counts_drafts_and_accepted_tokens_under_vllm_names(model) -> None:
    path, expected = model

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(f"tokenyard:spec_decode_{name}_total", labels) or 0.0

    before = {name: sample(name) for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    first_before = sample("num_accepted_tokens_per_pos", position="0")
    run_engine, _, runner = engine(path, 64, 256, 2, 3, proposer=ReferenceProposer(expected, 3))
    run_engine.run(submits())
    spec = runner.speculator
    assert 0 < spec.accepted_tokens < spec.draft_tokens  # every third proposed token is wrong
    assert sample("num_drafts") - before["num_drafts"] == spec.drafts
    assert sample("num_draft_tokens") - before["num_draft_tokens"] == spec.draft_tokens
    assert sample("num_accepted_tokens") - before["num_accepted_tokens"] == spec.accepted_tokens
    assert sample("num_accepted_tokens_per_pos", position="0") - first_before == spec.accepted_per_position[0]
    assert sum(spec.accepted_per_position) == spec.accepted_tokens
    assert spec.accepted_per_position == sorted(spec.accepted_per_position, reverse=True)  # a position is accepted only after those before it
    facts = runner.describe()["speculative"]
    assert facts["method"] == "ngram" and facts["acceptance_rate"] == round(spec.accepted_tokens / spec.draft_tokens, 4)


def test_each_result_says_what_its_verifies_proposed_and_no_guess_is_no_rejection(model) -> None:
    """A request its proposer never has a guess for keeps its verifies (each a plain decode) rather than backing off."""
    path, expected = model
    proposer = ReferenceProposer(expected, 1000)
    propose = proposer.propose
    proposer.propose = lambda wanted: {rid: proposal for rid, proposal in propose(wanted).items() if rid != "r1"}
    run_engine, scheduler, runner = engine(path, 64, 256, 2, 3, proposer=proposer)
    steps = recorded_steps(run_engine)
    result = run_engine.run(submits())
    assert result.outputs == {**expected, "r2": expected["r2"][: NEW_TOKENS - 1]}
    for drafts, step_result in steps:
        assert step_result.proposed == {rid: 0 if rid == "r1" else draft for rid, draft in drafts.items()}
    r1_verifies = sum("r1" in drafts for drafts, _ in steps)
    assert r1_verifies >= NEW_TOKENS - 4  # every decode but those its end rule keeps plain


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(model) -> None:
    path, expected = model
    # A token the continuation holds past the first few, so a run of accepted tokens may cross it.
    stop = expected["r0"][6]
    plain, _, _ = engine(path, 64, 256, 2, 0)
    speculative, scheduler, _ = engine(path, 64, 256, 2, 4, proposer=ReferenceProposer(expected, 1000))
    off, on = plain.run(submits(stop)), speculative.run(submits(stop))
    assert on.outputs == off.outputs and on.finish == off.finish
    assert on.outputs["r0"][-1] == stop and on.finish["r0"] == FinishReason.STOP
    assert scheduler.pool.num_used == 0


def test_beyond_max_batch_no_request_speculates(model) -> None:
    path, expected = model
    run_engine, _, runner = engine(path, 64, 256, 2, 3, max_batch=2, proposer=ReferenceProposer(expected, 1000))
    result = run_engine.run(submits())
    assert result.outputs == {**expected, "r2": expected["r2"][: NEW_TOKENS - 1]}
    assert runner.speculator.drafts == 0  # five requests ran together from the start


def test_aborts_while_verifies_are_in_flight_free_every_block(model) -> None:
    path, expected = model
    run_engine, scheduler, runner = engine(path, 64, 256, 2, 3, proposer=ReferenceProposer(expected, 3))
    outputs = run_with_aborts(run_engine, scheduler, runner, submits(), aborted=("r0", "r3"))
    for rid in ("r1", "r4"):
        assert outputs[rid] == expected[rid]
    for rid in ("r0", "r3"):
        assert outputs.get(rid, []) == expected[rid][: len(outputs.get(rid, []))]
    assert scheduler.pool.num_used == 0 and len(runner.requests) == 0
    scheduler.pool.check()


def test_seeded_sampled_requests_verify_by_rejection_sampling_and_repeat_themselves(model) -> None:
    """Sampled requests go through the rejection sampler in the step's batch; with a seed each one's tokens are
    the same from run to run (its uniforms come from its own generator), and near-greedy ones accept proposals."""
    path, expected = model
    work = [
        msgspec.structs.replace(s, sampling=SamplingParams(temperature=0.1 if i % 2 else 1.0, top_p=0.9, seed=100 + i), max_tokens=NEW_TOKENS)
        for i, s in enumerate(submits())
    ]
    outputs = []
    for _ in range(2):
        run_engine, scheduler, runner = engine(path, 64, 256, 2, 3, proposer=ReferenceProposer(expected, 1000))
        outputs.append(run_engine.run(work).outputs)
        assert runner.speculator.accepted_tokens > 0 and scheduler.pool.num_used == 0
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == NEW_TOKENS for tokens in outputs[0].values())


def test_penalised_and_biased_greedy_requests_are_the_same_with_speculation(model) -> None:
    """Each verified row is processed as the sampler would at its position: the penalties count the tokens
    accepted before it in the same verify, and logit bias applies."""
    path, expected = model
    params = SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.2, logit_bias={LOOP[0]: 2.0})
    work = [msgspec.structs.replace(s, sampling=params) for s in submits()]
    plain, _, _ = engine(path, 64, 7, 2, 0)
    speculative, scheduler, runner = engine(path, 64, 7, 2, 3, proposer=ReferenceProposer(expected, 4))
    off, on = plain.run(work), speculative.run(work)
    assert on.outputs == off.outputs
    assert runner.speculator.accepted_tokens > 0 and scheduler.pool.num_used == 0
