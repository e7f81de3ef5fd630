"""ModelRunner's request state and contract: seeds across batches, non-sampling chunks, release,
clear errors for malformed plans, warm-up and the facts it reports."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from services.worker.runner import ModelRunner, RunnerConfig
from shared.frames import SamplingParams, Slice, StepPlan

from .harness import GREEDY, Checkpoint, drive


def _prompt(seed: int, length: int) -> list[int]:
    return random.Random(seed).choices(range(3, 256), k=length)


@pytest.fixture
def untied(tiny_llamas: dict[str, Checkpoint]) -> Checkpoint:
    return tiny_llamas["untied"]


def test_seeded_request_samples_the_same_tokens_whatever_shares_its_steps(untied: Checkpoint) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    prompt = _prompt(0, 9)
    alone, _ = drive(ModelRunner(RunnerConfig(untied.path, 32, 4)), {"s": prompt}, 16, chunk=4, sampling={"s": seeded})
    prompts = {"s": prompt, "a": _prompt(1, 12), "b": _prompt(2, 5)}
    sampling = {"s": seeded, "a": SamplingParams(temperature=0.7, seed=8), "b": SamplingParams(temperature=1.3)}
    crowded, stats = drive(ModelRunner(RunnerConfig(untied.path, 64, 4)), prompts, 16, chunk=4, seed=1, arrivals={"b": 2}, sampling=sampling)
    assert stats.mixed_steps > 0
    assert crowded["s"] == alone["s"]
    assert len(set(alone["s"])) > 2  # it really samples
    other_seed, _ = drive(
        ModelRunner(RunnerConfig(untied.path, 32, 4)), {"s": prompt}, 16, chunk=4, sampling={"s": SamplingParams(temperature=1.0, top_p=0.9, seed=9)}
    )
    assert other_seed["s"] != alone["s"]


def test_non_final_chunks_sample_nothing_and_results_follow_plan_order(untied: Checkpoint) -> None:
    runner = ModelRunner(RunnerConfig(untied.path, 16, 4))
    result = runner.execute(
        StepPlan(
            0,
            [
                Slice("x", 0, 4, _prompt(0, 4), [3], sample=False, sampling=GREEDY),
                Slice("y", 0, 3, _prompt(1, 3), [5], sampling=GREEDY),
                Slice("z", 0, 2, _prompt(2, 2), [9], sampling=GREEDY),
            ],
        )
    )
    assert [s.rid for s in result.sampled] == ["y", "z"]
    assert result.step == 0 and result.forward_s > 0 and not result.error
    result = runner.execute(StepPlan(1, [Slice("z", 2, 1), Slice("x", 4, 2, _prompt(3, 2), [1]), Slice("y", 3, 1)]))
    assert [s.rid for s in result.sampled] == ["z", "x", "y"]


def test_release_drops_state_and_unknown_decodes_fail_clearly(untied: Checkpoint) -> None:
    runner = ModelRunner(RunnerConfig(untied.path, 16, 4))
    runner.execute(StepPlan(0, [Slice("a", 0, 3, [5, 6, 7], [0], sampling=GREEDY), Slice("b", 0, 3, [5, 6, 7], [1], sampling=GREEDY)]))
    assert runner.describe()["requests"] == 2
    runner.release(["a", "never-seen"])
    assert runner.describe()["requests"] == 1
    with pytest.raises(ValueError, match="decode slice for unknown request 'a'"):
        runner.execute(StepPlan(1, [Slice("b", 3, 1), Slice("a", 3, 1)]))
    # The failed step changed nothing: b decodes as it would have.
    expected = ModelRunner(RunnerConfig(untied.path, 16, 4))
    expected.execute(StepPlan(0, [Slice("b", 0, 3, [5, 6, 7], [1], sampling=GREEDY)]))
    assert runner.execute(StepPlan(2, [Slice("b", 3, 1)])).sampled == expected.execute(StepPlan(1, [Slice("b", 3, 1)])).sampled


@pytest.mark.parametrize(
    ("slices", "message"),
    [
        ([Slice("q", 0, 1)], "decode slice for unknown request 'q'"),
        ([Slice("p", 0, 3, [1, 2, 3], [0], sample=False), Slice("p", 3, 1)], "more than one slice"),
        ([Slice("q", 0, 3, [1, 2], [0])], "carries 2 token ids but num_tokens=3"),
        ([Slice("q", 0, 5, [1, 2, 3, 4, 5], [0])], "reaches position 4 but its 1 blocks of 4 hold 4 tokens"),
        ([Slice("q", 0, 2, [1, 2], [16])], "names blocks outside 0..15"),
        ([Slice("q", 0, 2, [1, 256], [0])], "token ids outside the vocabulary of 256"),
    ],
)
def test_malformed_slices_raise_clear_errors(untied: Checkpoint, slices: list[Slice], message: str) -> None:
    runner = ModelRunner(RunnerConfig(untied.path, 16, 4))
    with pytest.raises(ValueError, match=message):
        runner.execute(StepPlan(0, slices))
    assert runner.describe()["requests"] == 0


def test_decode_before_any_sampled_token_a_wrong_position_and_too_many_slices_fail(untied: Checkpoint) -> None:
    runner = ModelRunner(RunnerConfig(untied.path, 16, 4, max_num_seqs=2))
    runner.execute(StepPlan(0, [Slice("p", 0, 3, [1, 2, 3], [0], sample=False)]))
    with pytest.raises(ValueError, match="has not sampled a token yet"):
        runner.execute(StepPlan(1, [Slice("p", 3, 1)]))
    with pytest.raises(ValueError, match="starts at 2 but the request has computed 3 positions"):
        runner.execute(StepPlan(1, [Slice("p", 2, 1, [4])]))
    runner.execute(StepPlan(1, [Slice("p", 3, 1, [4])]))
    with pytest.raises(ValueError, match="starts at 5 but the request has computed 4 positions"):
        runner.execute(StepPlan(2, [Slice("p", 5, 1)]))
    with pytest.raises(ValueError, match="exceeds max_num_seqs=2"):
        runner.execute(StepPlan(2, [Slice(r, 0, 1, [1], [i]) for i, r in enumerate("xyz")]))


def test_warmup_leaves_no_state_and_describe_reads_the_live_objects(tiny_llamas: dict[str, Checkpoint]) -> None:
    tied = tiny_llamas["tied-sharded"]
    runner = ModelRunner(RunnerConfig(tied.path, num_blocks=10, block_size=4))
    runner.warmup()
    facts = runner.describe()
    assert facts["requests"] == 0
    assert facts["family"] == "llama" and facts["dtype"] == "float32"
    assert (facts["num_blocks"], facts["block_size"]) == (10, 4)
    config = tied.reference.config
    assert facts["kv_cache_bytes"] == config.num_hidden_layers * 10 * 4 * 2 * config.num_key_value_heads * config.head_dim * 4
    assert facts["param_count"] == tied.reference.num_parameters()  # the tied lm_head counted once
    assert facts["threads"] == torch.get_num_threads()


def test_unsupported_rope_type_and_family_are_rejected(tmp_path: Path, untied: Checkpoint) -> None:
    for name, patch, message in [
        ("yarn", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "rope type 'yarn' is not supported"),
        ("gpt2", {"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ]:
        path = tmp_path / name
        shutil.copytree(untied.path, path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config | patch))
        with pytest.raises(ValueError, match=message):
            ModelRunner(RunnerConfig(str(path), 4, 4))


def test_bfloat16_runs_close_to_the_fp32_reference(untied: Checkpoint) -> None:
    runner = ModelRunner(RunnerConfig(untied.path, 16, 4, dtype="bfloat16"))
    prompt = _prompt(5, 10)
    ours = runner.logits(StepPlan(0, [Slice("b", 0, 10, prompt, [4, 1, 7], sampling=GREEDY)]))["b"].float()
    with torch.no_grad():
        theirs = untied.reference(torch.tensor([prompt])).logits[0, -1]
    assert runner.describe()["dtype"] == "bfloat16"
    assert ((ours - theirs).norm() / theirs.norm()).item() < 0.05


PENALISED = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4, logit_bias={5: 2.0}, logprobs=3)


def _reference_processed(raw: torch.Tensor, prompt: list[int], outputs: list[int], params: SamplingParams) -> torch.Tensor:
    """The penalties written out token by token, as vLLM documents them (bias, then repetition, frequency, presence)."""
    logits = raw.clone().float()
    for token, bias in params.logit_bias.items():
        logits[token] += bias
    for token in set(prompt) | set(outputs):
        logits[token] = logits[token] / params.repetition_penalty if logits[token] > 0 else logits[token] * params.repetition_penalty
    for token in set(outputs):
        logits[token] -= params.frequency_penalty * outputs.count(token) + params.presence_penalty
    return logits


def test_penalties_see_every_token_of_the_request_through_chunks_recomputation_and_cached_prefixes(untied: Checkpoint) -> None:
    prompt = [7, 9, 7, 11, 12, 9, 30, 31, 7]  # repeats, so the repetition penalty bites from the first token
    runner = ModelRunner(RunnerConfig(untied.path, 32, 4))
    runner.execute(StepPlan(0, [Slice("p", 0, 5, prompt[:5], [0, 1], sample=False, sampling=PENALISED, prompt_len=len(prompt))]))
    results = [runner.execute(StepPlan(1, [Slice("p", 5, 4, prompt[5:], [2])])).sampled[0]]
    for step in range(7):
        results.append(runner.execute(StepPlan(2 + step, [Slice("p", len(prompt) + step, 1, new_blocks=[3 + step // 4] if step % 4 == 3 else [])])).sampled[0])
    outputs = [s.token_id for s in results]

    # The reference: the same positions' raw logits from a plain runner, penalised by the formula above.
    plain = ModelRunner(RunnerConfig(untied.path, 32, 4))
    raw = [plain.logits(StepPlan(0, [Slice("r", 0, len(prompt), prompt, [0, 1, 2], sampling=GREEDY)]))["r"]]
    for i, token in enumerate(outputs[:-1]):
        raw.append(plain.logits(StepPlan(1 + i, [Slice("r", len(prompt) + i, 1, [token], [3 + (i + 1) // 4] if i % 4 == 3 else [])]))["r"])
    for i, (sampled, logits) in enumerate(zip(results, raw)):
        expected = _reference_processed(logits, prompt, outputs[:i], PENALISED)
        logprobs = torch.log_softmax(expected, dim=-1)
        assert sampled.token_id == expected.argmax().item()
        assert sampled.logprobs.logprob == pytest.approx(logprobs[sampled.token_id].item(), abs=1e-5)
        assert sampled.logprobs.top_ids == logprobs.topk(3).indices.tolist()
    assert len(set(outputs)) > 3  # the penalties keep a tiny model from looping on one token

    # Recomputed after a preemption: the prefill holds prompt and 4 outputs; those 4 still count as outputs.
    again = ModelRunner(RunnerConfig(untied.path, 32, 4))
    tokens = prompt + outputs[:4]
    sampled = again.execute(StepPlan(0, [Slice("p", 0, len(tokens), tokens, [0, 1, 2, 3], sampling=PENALISED, prompt_len=len(prompt))])).sampled[0]
    assert sampled.token_id == outputs[4]
    # A prefix-cache hit: the first 8 prompt tokens' KV is in blocks 0-1 (written by another request); they arrive as prefix_ids.
    cached = ModelRunner(RunnerConfig(untied.path, 32, 4))
    cached.execute(StepPlan(0, [Slice("other", 0, 8, prompt[:8], [0, 1], sampling=GREEDY)]))
    hit = Slice("p", 8, 1, prompt[8:], [0, 1, 2], sampling=PENALISED, prompt_len=len(prompt), prefix_ids=prompt[:8])
    assert cached.execute(StepPlan(1, [hit])).sampled[0].token_id == outputs[0]


def test_logprobs_travel_only_when_asked(untied: Checkpoint) -> None:
    runner = ModelRunner(RunnerConfig(untied.path, 16, 4))
    result = runner.execute(
        StepPlan(0, [Slice("a", 0, 3, [5, 6, 7], [0], sampling=GREEDY), Slice("b", 0, 3, [5, 6, 7], [1], sampling=SamplingParams(temperature=0.0, logprobs=0))])
    )
    assert result.sampled[0].logprobs is None
    assert result.sampled[1].logprobs.top_ids == [] and result.sampled[1].logprobs.logprob < 0
