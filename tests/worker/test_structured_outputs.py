"""Structured outputs in the worker, on xgrammar, through the runner on a tiny model with SmolLM2's tokenizer:
greedy tokens are the argmax of transformers' logits among the tokens xgrammar allows, outputs held to a schema,
a regex, a choice grammar or a tool call's structural tag end whole and valid (``jsonschema``), a preempted
request's grammar resumes after its recomputed outputs, reasoning stays free until its end token, and grammars
compile ahead on their own thread."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch
import xgrammar as xgr

from services.worker.runner import ModelRunner, RunnerConfig
from services.worker.structured import GrammarState
from shared.devtools.random_model import build_random_smollm
from shared.frames import Grammar, GrammarKind, SamplingParams, Slice, StepPlan
from shared.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},  # xgrammar ignores maxLength beside a pattern
        "score": {"type": "integer", "minimum": 3, "maximum": 9},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "yé"]}, "maxItems": 3},
    },
    "required": ["name", "ok"],
    "additionalProperties": False,
}
EOS = 2  # SmolLM2's <|im_end|>


def schema_grammar(schema: dict) -> Grammar:
    return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema), strict=True)


@pytest.fixture(scope="module")
def tiny_smollm(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_random_smollm(str(tmp_path_factory.mktemp("structured") / "tiny-smollm"), "tiny", initializer_range=0.2)


@pytest.fixture(scope="module")
def runner(tiny_smollm: str) -> ModelRunner:
    return ModelRunner(RunnerConfig(tiny_smollm, 64, 8))


def run_to_end(runner: ModelRunner, rid: str, prompt: list[int], params: SamplingParams, limit: int = 160, stop_after: int | None = None) -> list[int]:
    """Tokens of one request until EOS (or ``stop_after`` tokens): prefill, then decode steps; released at the end."""
    out = []
    result = runner.execute(StepPlan(0, [Slice(rid, 0, len(prompt), prompt, list(range(40)), sampling=params)]))
    position = len(prompt)
    try:
        for step in range(1, limit):
            token = result.sampled[0].token_id
            out.append(token)
            if token == EOS or (stop_after is not None and len(out) >= stop_after):
                return out
            result = runner.execute(StepPlan(step, [Slice(rid, position, 1)]))
            position += 1
    finally:
        runner.release([rid])
    raise AssertionError(f"no EOS within {limit} tokens")


def test_greedy_tokens_are_the_argmax_of_the_models_logits_among_the_tokens_the_grammar_allows(tiny_smollm: str, runner: ModelRunner) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_smollm)
    model = AutoModelForCausalLM.from_pretrained(tiny_smollm, torch_dtype=torch.float32)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[EOS])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    prompt = tokenizer.encode("Answer in JSON:")
    tokens = run_to_end(runner, "argmax", prompt, SamplingParams(temperature=0, grammar=schema_grammar(SCHEMA)))
    bitmask = xgr.allocate_token_bitmask(1, 49152)
    constrained_choices = 0
    with torch.no_grad():
        for i, token in enumerate(tokens):
            logits = model(torch.tensor([prompt + tokens[:i]])).logits[0, -1].float()
            matcher.fill_next_token_bitmask(bitmask)
            words = bitmask[0].to(torch.int64) & 0xFFFFFFFF  # bit t % 32 of word t // 32: token t is allowed
            allowed = ((words[:, None] >> torch.arange(32)) & 1).bool().flatten()[:49152]
            expected = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            assert token == expected, (i, tokenizer.decode(tokens[: i + 1]))
            constrained_choices += int(allowed.sum()) < 49152 and int(logits.argmax()) != expected
            assert matcher.accept_token(token)
    assert constrained_choices > 0  # the grammar changed the model's choice somewhere: the check bit
    jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_the_runner_holds_a_random_model_to_the_schema_until_it_ends(tiny_smollm: str, runner: ModelRunner, temperature: float) -> None:
    tokenizer = load_tokenizer(tiny_smollm)
    params = SamplingParams(temperature=temperature, seed=5, grammar=schema_grammar(SCHEMA))
    tokens = run_to_end(runner, "r", tokenizer.encode("Answer in JSON:"), params)
    jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)
    assert tokens[-1] == EOS


@pytest.mark.parametrize(
    ("grammar", "check"),
    [
        (Grammar(GrammarKind.REGEX, r"[A-Z][a-z]{2,5}-\d{3}"), lambda text: re.fullmatch(r"[A-Z][a-z]{2,5}-\d{3}", text)),
        (Grammar(GrammarKind.EBNF, 'root ::= "yes" | "no" | "maybe so"'), lambda text: text in ("yes", "no", "maybe so")),
        (
            Grammar(GrammarKind.EBNF, 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]*'),
            lambda text: re.fullmatch(r"\([1-9][0-9]*(\+[1-9][0-9]*)*\)", text),
        ),
    ],
    ids=["regex", "choice", "gbnf"],
)
def test_regex_choice_and_ebnf_grammars_hold_the_output(tiny_smollm: str, runner: ModelRunner, grammar: Grammar, check) -> None:
    tokenizer = load_tokenizer(tiny_smollm)
    for seed in range(3):
        tokens = run_to_end(runner, "g", tokenizer.encode("Say:"), SamplingParams(temperature=1.0, seed=seed, grammar=grammar))
        assert check(tokenizer.decode(tokens, skip_special_tokens=True)), tokenizer.decode(tokens)


def test_a_tool_call_structural_tag_holds_the_output_to_one_call_between_its_tags(tiny_smollm: str, runner: ModelRunner) -> None:
    tokenizer = load_tokenizer(tiny_smollm)
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": '<tool_call>\n{"name": "f", "arguments": ',
            "content": {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 1},  # as the api sends it
            "end": "}\n</tool_call>",
        },
    }
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, grammar=Grammar(GrammarKind.STRUCTURAL_TAG, json.dumps(tag)))
        text = tokenizer.decode(run_to_end(runner, "t", tokenizer.encode("Call:"), params), skip_special_tokens=True)
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        assert call["name"] == "f"
        jsonschema.validate(call["arguments"], SCHEMA)


def test_a_preempted_request_resumes_its_grammar_from_its_recomputed_outputs(tiny_smollm: str, runner: ModelRunner) -> None:
    prompt = load_tokenizer(tiny_smollm).encode("Answer in JSON:")
    params = SamplingParams(temperature=0, grammar=schema_grammar(SCHEMA))
    whole = run_to_end(runner, "a", prompt, params)
    first = run_to_end(runner, "b", prompt, params, stop_after=5)  # then preempted: recomputed from its prompt and outputs
    recomputed = prompt + first
    result = runner.execute(StepPlan(0, [Slice("b", 0, len(recomputed), recomputed, list(range(40)), sampling=params, prompt_len=len(prompt))]))
    rest, position = [result.sampled[0].token_id], len(recomputed)
    while rest[-1] != EOS:
        result = runner.execute(StepPlan(1, [Slice("b", position, 1)]))
        rest.append(result.sampled[0].token_id)
        position += 1
        assert len(rest) < 160
    runner.release(["b"])
    assert first + rest == whole


def test_reasoning_is_free_until_its_end_token_and_the_answer_follows_the_grammar_after_it(tiny_smollm: str, runner: ModelRunner) -> None:
    tokenizer = load_tokenizer(tiny_smollm)
    prompt = tokenizer.encode("Answer in JSON:")
    end = tokenizer.encode("</think>", add_special_tokens=False)
    params = SamplingParams(temperature=0, grammar=schema_grammar(SCHEMA), grammar_after=end)
    free = run_to_end(runner, "free", prompt, SamplingParams(temperature=0), stop_after=6)
    still_thinking = run_to_end(runner, "thinking", prompt, params, stop_after=6)
    assert still_thinking == free  # no end token yet: unconstrained
    thought = tokenizer.encode("<think>I think.", add_special_tokens=False) + end  # outputs recomputed after a preemption
    recomputed = prompt + thought
    result = runner.execute(StepPlan(0, [Slice("answer", 0, len(recomputed), recomputed, list(range(40)), sampling=params, prompt_len=len(prompt))]))
    answer, position = [result.sampled[0].token_id], len(recomputed)
    while answer[-1] != EOS:
        result = runner.execute(StepPlan(1, [Slice("answer", position, 1)]))
        answer.append(result.sampled[0].token_id)
        position += 1
        assert len(answer) < 160
    runner.release(["answer"])
    jsonschema.validate(json.loads(tokenizer.decode(answer, skip_special_tokens=True)), SCHEMA)


def test_a_grammar_state_rolls_back_rejected_tokens(tiny_smollm: str, runner: ModelRunner) -> None:
    tokenizer = load_tokenizer(tiny_smollm)
    state: GrammarState = runner.structured.start(SamplingParams(grammar=schema_grammar(SCHEMA)))
    for token in tokenizer.encode('{"name": "ab', add_special_tokens=False):
        assert state.accept(token)
    assert not state.accept(tokenizer.encode("}", add_special_tokens=False)[0])  # a string is open
    state.rollback(2)
    assert state.accepted == len(tokenizer.encode('{"name": "ab', add_special_tokens=False)) - 2


def test_a_plan_whose_grammar_does_not_compile_is_refused_and_changes_nothing(runner: ModelRunner) -> None:
    for bad in (Grammar(GrammarKind.JSON_SCHEMA, "{not json"), Grammar(GrammarKind.REGEX, "a(b"), Grammar(GrammarKind.EBNF, "root ::= x")):
        with pytest.raises(ValueError):
            runner.execute(StepPlan(0, [Slice("r", 0, 3, [5, 6, 7], [0], sampling=SamplingParams(temperature=0, grammar=bad))]))
        assert runner.describe()["requests"] == 0


def test_grammars_compiled_ahead_are_reported_once_each_with_their_errors(runner: ModelRunner) -> None:
    structured = runner.structured
    structured.compile_ahead("good", schema_grammar(SCHEMA))
    structured.compile_ahead("bad", Grammar(GrammarKind.REGEX, "a(b"))
    done: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while len(done) < 2 and time.monotonic() < deadline:
        done.update(structured.compiled())
        time.sleep(0.01)
    assert done["good"] == "" and "parenthesis" in done["bad"]
    assert structured.compiled() == [] and not structured.compiling


def test_past_its_end_a_grammar_allows_only_stop_tokens(tiny_smollm: str, runner: ModelRunner) -> None:
    tokenizer = load_tokenizer(tiny_smollm)
    params = SamplingParams(temperature=1.0, seed=3, grammar=Grammar(GrammarKind.REGEX, "(yes|no)"))
    prompt = tokenizer.encode("Say:")
    result = runner.execute(StepPlan(0, [Slice("past", 0, len(prompt), prompt, list(range(40)), sampling=params)]))
    out = [result.sampled[0].token_id]
    for step in range(1, 12):  # decoded on past EOS, as with ignore_eos or min_tokens
        result = runner.execute(StepPlan(step, [Slice("past", len(prompt) + step - 1, 1)]))
        out.append(result.sampled[0].token_id)
    runner.release(["past"])
    end = out.index(EOS)
    assert tokenizer.decode(out[:end]) in ("yes", "no") and out[end:] == [EOS] * (len(out) - end)


BOUNDED = {
    "type": "object",
    "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"type": "string", "minLength": 2}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("kind", ["json_schema", "structural_tag"])
def test_length_bounded_strings_take_json_characters_and_escapes_only(runner: ModelRunner, kind: str) -> None:
    if kind == "json_schema":
        grammar = schema_grammar(BOUNDED)
    else:
        tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "content": {"type": "json_schema", "json_schema": BOUNDED}, "end": "</a>"}}
        grammar = Grammar(GrammarKind.STRUCTURAL_TAG, json.dumps(tag))
    compiled = runner.structured.compile(grammar)

    def whole(json_text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        text = json_text if kind == "json_schema" else f"<a>{json_text}</a>"
        return matcher.accept_string(text) and matcher.is_terminated()

    assert whole('{"a": "abc", "b": "xy"}') and whole('{"a": "é\\n\\"", "b": "\\u00e9\\\\"}')
    assert not whole('{"a": "ab\\tc", "b": "xy"}')  # four characters, an escape counting one
    for control in "\x00\x0e\t\x1f\n":  # raw control characters are not JSON
        assert not whole(f'{{"a": "a{control}", "b": "xy"}}') and not whole(f'{{"a": "a", "b": "x{control}"}}')
