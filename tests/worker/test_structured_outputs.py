"""Structured outputs in the worker: the allowed-token masks against a brute force over the vocabulary, greedy
rows taking the most likely allowed token, outputs that the ``jsonschema`` validator accepts (greedy and sampled,
on random logits and through the runner on a tiny model with SmolLM2's tokenizer), and a preempted request's
grammar resuming where its output was."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from services.worker.runner import ModelRunner, RunnerConfig
from services.worker.sampling import sample
from services.worker.structured import StructuredOutputs, Vocabulary
from shared.devtools.random_model import build_random_smollm
from shared.frames import SamplingParams, Slice, StepPlan
from shared.json_grammar import JsonGrammar, Matcher
from shared.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "yé"]}, "maxItems": 3},
    },
    "required": ["name", "ok"],
    "additionalProperties": False,
}
EOS = 0


def toy_vocabulary() -> Vocabulary:
    """Token 0 is EOS, 1 a special token; then every printable ASCII byte, UTF-8 pieces and multi-byte tokens."""
    pieces = [None, None] + [bytes((b,)) for b in range(0x20, 0x7F)] + [b"\n", b"\xc3", b"\xa9", "é".encode(), b"\xa9x"]
    pieces += [b'{"', b'":', b'", "', b"name", b" true", b"}\n", b'"}', b"12", b"1.5", b"fal", b'"x"', b"\\n", b'a"', b"  ", b'{"ok"']
    return Vocabulary(pieces, [EOS])


def brute_force_allowed(vocabulary: Vocabulary, matcher: Matcher) -> set[int]:
    allowed = {t for t, data in enumerate(vocabulary.token_bytes) if data and matcher.feed(data) is not None}
    return allowed | ({EOS} if matcher.complete else set())


def generate(outputs: StructuredOutputs, schema: dict, rng: random.Random, greedy: bool, steps: int = 400) -> bytes:
    """Random logits each step; the chosen token held to the grammar; until EOS. Checks greedy picks against brute force."""
    matcher, out, vocabulary = outputs.grammar(json.dumps(schema)).start(), bytearray(), outputs.vocabulary
    params = SamplingParams(temperature=0 if greedy else 1.0)
    for _ in range(steps):
        logits = torch.tensor([[rng.gauss(0, 2) for _ in range(vocabulary.size)]])
        chosen = sample(logits, [params], [None]).tolist()
        (token,), (after,) = outputs.enforce(logits, chosen, [0], [matcher], lambda row, masked: int(sample(masked, [params], [None])[0]))
        allowed = brute_force_allowed(vocabulary, matcher)
        assert token in allowed
        if greedy:
            assert token == max(allowed, key=lambda t: logits[0, t].item())
        if token == EOS:
            return bytes(out)
        out += vocabulary.token_bytes[token]
        matcher = after
    raise AssertionError(f"no end after {steps} tokens: {bytes(out)!r}")


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_outputs_held_to_the_grammar_are_valid_json_under_the_schema(greedy: bool) -> None:
    outputs, rng = StructuredOutputs(toy_vocabulary()), random.Random(3)
    for _ in range(12):
        document = generate(outputs, SCHEMA, rng, greedy)
        jsonschema.validate(json.loads(document), SCHEMA)


def test_masks_equal_a_brute_force_over_the_vocabulary_in_every_kind_of_state() -> None:
    vocabulary = toy_vocabulary()
    outputs = StructuredOutputs(vocabulary)
    grammar = JsonGrammar(SCHEMA)
    prefixes = [
        "",
        '{"',
        '{"name"',
        '{"name": "ab',
        '{"name": "abcdef',
        '{"ok": true',
        '{"ok": true, "score": 1',
        '{"tags": ["y\xc3',
        '{"ok": false, "name": ""}',
    ]
    any_grammar = JsonGrammar(True)
    states = [grammar.start().feed(p.encode("latin-1")) for p in prefixes] + [any_grammar.start().feed(b'["free text '), any_grammar.start().feed(b"[1")]
    assert any(s.in_plain_string for s in states), "the plain-string path must be among those checked"
    for state in states:
        assert state is not None
        mask = outputs.mask(state)
        assert set(mask.nonzero().flatten().tolist()) == brute_force_allowed(vocabulary, state)
    assert set(outputs.mask(states[-3]).nonzero().flatten().tolist()) == {EOS}  # a closed object: only the end


def test_special_tokens_are_never_text() -> None:
    vocabulary = toy_vocabulary()
    state = JsonGrammar(True).start().feed(b'"')
    assert not StructuredOutputs(vocabulary).mask(state)[1]
    assert not StructuredOutputs(vocabulary).allows(state, 1)


@pytest.fixture(scope="module")
def tiny_smollm(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_random_smollm(str(tmp_path_factory.mktemp("structured") / "tiny-smollm"), "tiny", initializer_range=0.2)


def run_to_end(runner: ModelRunner, rid: str, prompt: list[int], params: SamplingParams, limit: int = 160, stop_after: int | None = None) -> list[int]:
    """Greedy or sampled tokens of one request until EOS (or ``stop_after`` tokens): prefill, then decode steps."""
    blocks = list(range(0, 64))
    out = []
    result = runner.execute(StepPlan(0, [Slice(rid, 0, len(prompt), prompt, blocks[:40], sampling=params)]))
    position = len(prompt)
    for step in range(1, limit):
        token = result.sampled[0].token_id
        out.append(token)
        if token == 2 or (stop_after is not None and len(out) >= stop_after):  # SmolLM2's EOS: <|im_end|>
            return out
        result = runner.execute(StepPlan(step, [Slice(rid, position, 1)]))
        position += 1
    raise AssertionError(f"no EOS within {limit} tokens")


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_the_runner_holds_a_random_model_to_the_schema_until_it_ends(tiny_smollm: str, temperature: float) -> None:
    runner = ModelRunner(RunnerConfig(tiny_smollm, 64, 8))
    tokenizer = load_tokenizer(tiny_smollm)
    params = SamplingParams(temperature=temperature, seed=5, json_schema=json.dumps(SCHEMA))
    tokens = run_to_end(runner, "r", tokenizer.encode("Answer in JSON:"), params)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert tokens[-1] == 2


def test_a_preempted_request_resumes_its_grammar_from_its_recomputed_outputs(tiny_smollm: str) -> None:
    runner = ModelRunner(RunnerConfig(tiny_smollm, 64, 8))
    tokenizer = load_tokenizer(tiny_smollm)
    prompt = tokenizer.encode("Answer in JSON:")
    params = SamplingParams(temperature=0, json_schema=json.dumps(SCHEMA))
    whole = run_to_end(runner, "a", prompt, params)
    runner.release(["a"])
    first = run_to_end(runner, "b", prompt, params, stop_after=5)
    runner.release(["b"])  # preempted: recomputed from its prompt and the outputs so far
    recomputed = prompt + first
    result = runner.execute(StepPlan(0, [Slice("b", 0, len(recomputed), recomputed, list(range(40)), sampling=params, prompt_len=len(prompt))]))
    rest, position = [result.sampled[0].token_id], len(recomputed)
    while rest[-1] != 2:
        result = runner.execute(StepPlan(1, [Slice("b", position, 1)]))
        rest.append(result.sampled[0].token_id)
        position += 1
        assert len(rest) < 160
    assert first + rest == whole


def test_a_plan_whose_schema_the_grammar_cannot_take_is_refused_and_changes_nothing(tiny_smollm: str) -> None:
    runner = ModelRunner(RunnerConfig(tiny_smollm, 64, 8))
    for bad in ("{not json", json.dumps({"type": "string", "pattern": "a"})):
        params = SamplingParams(temperature=0, json_schema=bad)
        with pytest.raises(ValueError):
            runner.execute(StepPlan(0, [Slice("r", 0, 3, [5, 6, 7], [0], sampling=params)]))
        assert runner.describe()["requests"] == 0


def test_a_tool_call_grammar_holds_the_output_to_one_call_between_its_tags() -> None:
    outputs, rng = StructuredOutputs(toy_vocabulary()), random.Random(9)
    call = {"type": "object", "properties": {"name": {"const": "f"}, "arguments": SCHEMA}, "propertyOrdering": ["name", "arguments"]}
    grammar = outputs.grammar(json.dumps(call), "<call>", "</call>")
    params = SamplingParams(temperature=1.0)
    for _ in range(6):
        matcher, out = grammar.start(), bytearray()
        while True:
            logits = torch.tensor([[rng.gauss(0, 2) for _ in range(outputs.vocabulary.size)]])
            chosen = sample(logits, [params], [None]).tolist()
            (token,), (after,) = outputs.enforce(logits, chosen, [0], [matcher], lambda row, masked: int(sample(masked, [params], [None])[0]))
            if token == EOS:
                break
            out += outputs.vocabulary.token_bytes[token]
            matcher = after
            assert len(out) < 2000
        text = out.decode()
        assert text.startswith("<call>") and text.endswith("</call>")
        body = json.loads(text.removeprefix("<call>").removesuffix("</call>"))
        assert list(body) == ["name", "arguments"] and body["name"] == "f"
        jsonschema.validate(body["arguments"], SCHEMA)
