"""OpenAI request bodies as msgspec structs, and their validation into one internal request.

Unknown fields are refused (as the OpenAI API does) and every accepted field is honoured
or refused with a 400 that names it: nothing is silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.api.errors import ApiError
from shared.frames import SamplingParams

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16


class _Body(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Body):
    type: str
    text: str = ""


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ResponseFormat(_Body):
    type: str


class _SamplingBody(_Body):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI plus vLLM extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool | int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = []
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionRequest(_SamplingBody):
    prompt: str | list[str | int | list[int]] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


@dataclass
class Generation:
    """A validated request: everything the route needs besides the prompt(s)."""

    model: str
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: whatever the context leaves
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True


def decode_body(data: bytes, kind: type[_Body]) -> Any:
    return msgspec.json.decode(data, type=kind)


def _check(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise ApiError(400, message, param=param)


def validate_sampling(body: _SamplingBody, served_model: str, max_tokens: int | None, max_tokens_param: str) -> Generation:
    _check(body.model is not None, "model", "you must provide a model parameter")
    if body.model != served_model:
        raise ApiError(404, f"The model `{body.model}` does not exist; this server serves `{served_model}`.", param="model", code="model_not_found")
    _check(max_tokens is None or max_tokens >= 1, max_tokens_param, f"{max_tokens_param} must be at least 1, got {max_tokens}")
    temperature = 1.0 if body.temperature is None else body.temperature
    _check(0.0 <= temperature <= 2.0, "temperature", f"temperature must be between 0 and 2, got {temperature}")
    top_p = 1.0 if body.top_p is None else body.top_p
    _check(0.0 < top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {top_p}")
    top_k = 0 if body.top_k is None or body.top_k == -1 else body.top_k
    _check(top_k >= 0, "top_k", f"top_k must be -1 (disabled) or at least 0, got {body.top_k}")
    min_p = 0.0 if body.min_p is None else body.min_p
    _check(0.0 <= min_p <= 1.0, "min_p", f"min_p must be between 0 and 1, got {min_p}")
    _check(1 <= body.n <= MAX_CHOICES, "n", f"n must be between 1 and {MAX_CHOICES}, got {body.n}")
    _check(body.min_tokens >= 0, "min_tokens", f"min_tokens must be at least 0, got {body.min_tokens}")
    _check(
        max_tokens is None or body.min_tokens <= max_tokens, "min_tokens", f"min_tokens ({body.min_tokens}) must not exceed {max_tokens_param} ({max_tokens})"
    )
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    _check(len(stops) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    _check(all(stops), "stop", "stop strings must not be empty")
    _unsupported(body.presence_penalty == 0.0, "presence_penalty", "a non-zero presence_penalty")
    _unsupported(body.frequency_penalty == 0.0, "frequency_penalty", "a non-zero frequency_penalty")
    _unsupported(body.repetition_penalty == 1.0, "repetition_penalty", "a repetition_penalty other than 1")
    _unsupported(not body.logprobs, "logprobs", "logprobs")
    _unsupported(not body.logit_bias, "logit_bias", "logit_bias")
    include_usage = False
    if body.stream_options is not None:
        _check(body.stream, "stream_options", "stream_options is only allowed when stream is true")
        include_usage = body.stream_options.include_usage
    return Generation(
        model=served_model,
        n=body.n,
        stream=body.stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=body.seed),
        stop=stops,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        skip_special_tokens=body.skip_special_tokens,
    )


def _unsupported(condition: bool, param: str, what: str) -> None:
    if not condition:
        raise ApiError(400, f"{what} is not supported by this server yet", param=param)


def validate_chat(body: ChatCompletionRequest, served_model: str) -> tuple[Generation, list[dict[str, Any]]]:
    _check(len(body.messages) > 0, "messages", "messages must be a non-empty list")
    if body.max_tokens is not None and body.max_completion_tokens is not None and body.max_tokens != body.max_completion_tokens:
        raise ApiError(400, "max_tokens and max_completion_tokens disagree; send one of them", param="max_completion_tokens")
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    generation = validate_sampling(body, served_model, body.max_completion_tokens or body.max_tokens, param)
    _unsupported(not body.tools, "tools", "tool calling")
    _unsupported(body.tool_choice in (None, "none"), "tool_choice", "tool_choice")
    _unsupported(body.top_logprobs is None, "top_logprobs", "top_logprobs")
    if body.response_format is not None:
        _unsupported(body.response_format.type == "text", "response_format", f"response_format of type {body.response_format.type!r}")
    messages = []
    for i, message in enumerate(body.messages):
        _check(
            message.role in ("system", "developer", "user", "assistant"),
            f"messages[{i}].role",
            f"unknown role {message.role!r} in messages[{i}]; expected system, developer, user or assistant",
        )
        messages.append({"role": "system" if message.role == "developer" else message.role, "content": _content_text(message.content, i)})
    return generation, messages


def _content_text(content: str | list[TextPart] | None, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        _check(part.type == "text", f"messages[{index}].content[{j}].type", f"content parts of type {part.type!r} are not supported; only 'text'")
    return "".join(part.text for part in content)


PromptInput = str | list[int]


def validate_completion(body: CompletionRequest, served_model: str, vocab_size: int) -> tuple[Generation, list[PromptInput]]:
    _check(body.prompt is not None, "prompt", "you must provide a prompt")
    generation = validate_sampling(body, served_model, 16 if body.max_tokens is None else body.max_tokens, "max_tokens")
    _unsupported(body.suffix is None, "suffix", "suffix")
    _unsupported(body.best_of in (None, 1), "best_of", "best_of other than 1")
    prompts = _prompts(body.prompt)
    _check(len(prompts) * generation.n <= MAX_CHOICES * 4, "prompt", f"too many choices: {len(prompts)} prompts x n={generation.n}")
    for i, prompt in enumerate(prompts):
        _check(len(prompt) > 0, "prompt", f"prompt {i} is empty")
        if isinstance(prompt, list):
            _check(all(0 <= t < vocab_size for t in prompt), "prompt", f"prompt {i} has token ids outside the vocabulary [0, {vocab_size})")
    return generation, prompts


def _prompts(prompt: str | list[str | int | list[int]]) -> list[PromptInput]:
    """One prompt (text or token ids) or a batch of them; mixed lists are refused."""
    if isinstance(prompt, str):
        return [prompt]
    _check(len(prompt) > 0, "prompt", "prompt must not be an empty list")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[list-item]
    _check(
        all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt),
        "prompt",
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
    )
    return list(prompt)  # type: ignore[arg-type]
