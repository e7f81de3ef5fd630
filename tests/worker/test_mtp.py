"""Speculative decoding with a qwen3_next checkpoint's MTP layer (``--speculative-method mtp``) on a tiny random model
whose MTP weights are random too: greedy outputs are the same with and without it under chunked prefill, mixed
batches and preemption; its proposals are the MTP layer as vLLM defines it (computed on transformers' decoder
layer), chained; a proposal does not depend on how the request's positions were computed (chunks, verifies with
rejected tokens, plain decodes); and the worker refuses it where it cannot run."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from services.scheduler.core import Scheduler
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.speculation import Speculation
from services.scheduler.state_slots import SlotPool
from services.worker.runner import ModelRunner, RunnerConfig
from shared.devtools.inprocess_engine import InProcessEngine
from shared.frames import SamplingParams, Slice, StepPlan, Submit

from .harness import GREEDY, Checkpoint, prompt_of

pytestmark = pytest.mark.usefixtures("one_thread")

K = 3
BLOCK = 4


def with_mtp(tiny: Checkpoint, path: str) -> str:
    """A copy of the tiny checkpoint at ``path`` with a random MTP layer shaped as its layer 1 (full attention, MoE)."""
    shutil.copytree(tiny.path, path)
    generator = torch.Generator().manual_seed(7)
    weights = {}
    for name, tensor in tiny.reference.state_dict().items():
        if name.startswith("model.layers.1."):
            weights["mtp.layers.0." + name.removeprefix("model.layers.1.")] = torch.randn(tensor.shape, generator=generator) * 0.2
    hidden = tiny.reference.config.hidden_size
    weights["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.2
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=generator) * 0.1  # zero-centred: scales by 1 + w
    save_file(weights, os.path.join(path, "mtp.safetensors"))
    return path


@pytest.fixture(scope="module")
def mtp_model(tiny_qwen3_nexts: dict[str, Checkpoint], tmp_path_factory: pytest.TempPathFactory) -> str:
    return with_mtp(tiny_qwen3_nexts["gqa-dense-layer"], str(tmp_path_factory.mktemp("mtp") / "model"))


def engine(path: str, num_blocks: int, budget: int, k: int) -> tuple[InProcessEngine, Scheduler, ModelRunner]:
    runner = ModelRunner(
        RunnerConfig(path, num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=8, speculative_method="mtp" if k else "", verify_states=8 * k)
    )
    scheduler = Scheduler(BlockPool(num_blocks, BLOCK), 8, budget, 100, SlotPool(8), decode_plan_s=0.0, speculation=Speculation(k, 8) if k else None)
    return InProcessEngine(scheduler, runner, 2), scheduler, runner


@pytest.mark.parametrize("num_blocks,budget", [(64, 256), (64, 7), (14, 16)], ids=["whole-prompts", "chunks-beside-verifies", "preemption"])
def test_greedy_outputs_are_the_same_with_mtp_speculation(mtp_model: str, num_blocks: int, budget: int) -> None:
    work = [
        Submit(rid=f"r{i}", prompt_ids=prompt_of(30 + i, n), max_tokens=16, sampling=SamplingParams(temperature=0), ignore_eos=True)
        for i, n in enumerate((5, 12, 21, 9))
    ]
    off = engine(mtp_model, num_blocks, budget, 0)[0].run(work).outputs
    run, scheduler, runner = engine(mtp_model, num_blocks, budget, K)
    assert run.run(work[:2], arrivals={3: work[2:]}).outputs == off
    facts = runner.describe()["speculative"]
    assert runner.speculator.drafts > 0 and facts["method"] == "mtp" and facts["mtp"]["kv_cache_bytes"] == runner.kv_cache.nbytes  # one layer
    assert scheduler.pool.num_used == 0
    if num_blocks == 14:
        assert scheduler.num_preemptions > 0


class Recorder:
    """Wraps a proposer: its proposals, step by step."""

    def __init__(self, proposer) -> None:
        self.proposer, self.proposals = proposer, []

    def __getattr__(self, name: str):
        return getattr(self.proposer, name)

    def propose(self, wanted: dict[str, int]) -> dict[str, list[int]]:
        out = self.proposer.propose(wanted)
        self.proposals.append(out)
        return out


def step(runner: ModelRunner, *slices: Slice) -> list[int]:
    return [x.token_id for x in runner.execute(StepPlan(0, list(slices))).sampled]


def blocks(runner: ModelRunner, rid: str, end: int) -> list[int]:
    held = len(runner.requests[rid].table) if rid in runner.requests else 0
    return list(range(held, -(-end // BLOCK)))


def test_a_proposal_does_not_depend_on_how_the_positions_were_computed(mtp_model: str) -> None:
    """One request prefilled in two chunks, then verifies (random proposals, mostly rejected) and plain decodes; another
    runner prefills the same tokens at once. Their next proposals are the same."""
    config = RunnerConfig(mtp_model, num_blocks=64, block_size=BLOCK, max_num_seqs=2, speculative_method="mtp", verify_states=K)
    piecewise = ModelRunner(config)
    prompt = prompt_of(40, 13)
    tokens = list(prompt)
    step(piecewise, Slice("r", 0, 7, prompt[:7], blocks(piecewise, "r", 7), sample=False, sampling=GREEDY, slot=0))
    tokens += step(piecewise, Slice("r", 7, 6, prompt[7:], blocks(piecewise, "r", 13), slot=0))
    for draft in (K, 0, K, K, 0):
        n = len(tokens) - 1
        tokens += step(piecewise, Slice("r", n, 1 + draft, new_blocks=blocks(piecewise, "r", n + 1 + draft), slot=0))
    at_once = ModelRunner(config)
    assert step(at_once, Slice("r", 0, len(tokens) - 1, tokens[:-1], blocks(at_once, "r", len(tokens) - 1), sampling=GREEDY, slot=0)) == tokens[-1:]
    proposals = []
    for runner in (piecewise, at_once):
        recorder = runner.speculator.proposer = Recorder(runner.speculator.proposer)
        n = len(tokens) - 1
        step(runner, Slice("r", n, 1 + K, new_blocks=blocks(runner, "r", n + 1 + K), slot=0))
        proposals.append(recorder.proposals[-1]["r"])
    assert len(proposals[0]) == K and proposals[0] == proposals[1]


def test_the_worker_refuses_mtp_without_an_mtp_layer_or_with_decode_graphs(tiny_qwen3_nexts: dict[str, Checkpoint], mtp_model: str, tmp_path) -> None:
    with pytest.raises(ValueError, match="holds no MTP layer"):
        ModelRunner(RunnerConfig(tiny_qwen3_nexts["gqa-dense-layer"].path, num_blocks=16, block_size=BLOCK, speculative_method="mtp"))
    with pytest.raises(ValueError, match="CUDA graphs"):
        ModelRunner(RunnerConfig(mtp_model, num_blocks=16, block_size=BLOCK, speculative_method="mtp", cuda_graph_max_batch=4))
    from .harness import build_tiny

    build_tiny("llama", str(tmp_path))
    with pytest.raises(ValueError, match="a llama model has none"):
        ModelRunner(RunnerConfig(str(tmp_path), num_blocks=16, block_size=BLOCK, speculative_method="mtp"))


def reference_proposal(tiny: Checkpoint, mtp_path: str, tokens: list[int], count: int) -> list[int]:
    """The MTP layer as vLLM defines it, on transformers' decoder layer and norms over the whole sequence: token p + 1's
    embedding and the target's final-normed hidden state at p, each normed, through fc, the layer and its norm; then
    chained on its own output and argmax."""
    from safetensors.torch import load_file
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

    model, config = tiny.reference, tiny.reference.config
    weights = load_file(os.path.join(mtp_path, "mtp.safetensors"))
    layer = Qwen3NextDecoderLayer(config, layer_idx=1).eval()  # layer 1: full attention, MoE
    layer.load_state_dict({name.removeprefix("mtp.layers.0."): w for name, w in weights.items() if name.startswith("mtp.layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3NextRMSNorm(config.hidden_size, config.rms_norm_eps).eval()
        norms[name].load_state_dict({"weight": weights[f"mtp.{name}.weight"]})
    with torch.no_grad():
        hidden = model.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]  # positions 0..n-1
        inputs = list(tokens[1:])  # token p + 1 at position p
        proposals = []
        for _ in range(count):
            n = len(inputs)
            x = torch.cat([norms["pre_fc_norm_embedding"](model.model.embed_tokens(torch.tensor(inputs))), norms["pre_fc_norm_hidden"](hidden)], -1)
            x = (x @ weights["mtp.fc.weight"].T)[None]
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = norms["norm"](layer(x, position_embeddings=model.model.rotary_emb(x, positions), attention_mask=mask, position_ids=positions))[0]
            proposals.append(int(model.lm_head(out[-1]).argmax()))
            inputs.append(proposals[-1])
            hidden = torch.cat([hidden, out[-1:]])
    return proposals


def test_proposals_are_the_mtp_layer_chained_as_vllm_defines_it(tiny_qwen3_nexts: dict[str, Checkpoint], mtp_model: str) -> None:
    runner = ModelRunner(RunnerConfig(mtp_model, num_blocks=64, block_size=BLOCK, max_num_seqs=2, speculative_method="mtp", verify_states=K))
    recorder = runner.speculator.proposer = Recorder(runner.speculator.proposer)
    prompt = prompt_of(41, 11)
    tokens = prompt + step(runner, Slice("r", 0, 11, prompt, blocks(runner, "r", 11), sampling=GREEDY, slot=0))
    step(runner, Slice("r", 11, 1 + K, new_blocks=blocks(runner, "r", 12 + K), slot=0))
    assert recorder.proposals[-1]["r"] == reference_proposal(tiny_qwen3_nexts["gqa-dense-layer"], mtp_model, tokens, K)


def test_under_a_device_budget_the_mtp_layers_kv_comes_off_the_blocks(mtp_model: str) -> None:
    """The profile step runs before any KV cache exists; then, as the tiny model has one full-attention layer, a block
    with the MTP layer's KV beside it costs twice as much."""
    from services.worker.device_memory import KVBudget

    from .test_device import GIB, FakeProbe

    budget = KVBudget(lambda *_: 40, profile_tokens=8, probe=FakeProbe(GIB, GIB, GIB))
    runner = ModelRunner(RunnerConfig(mtp_model, 1, BLOCK, max_num_seqs=2, speculative_method="mtp", verify_states=K), budget=budget)
    assert runner.num_blocks == 20 and runner.kv_cache.num_blocks == 20 and runner.speculator.proposer.kv_cache.num_blocks == 20
