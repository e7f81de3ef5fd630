"""OpenAI-compatible routes: /v1/chat/completions (with tool calls and reasoning), /v1/completions, /v1/models."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from services.api.errors import ApiError
from services.api.generation import (
    ChoiceResult,
    build_submits,
    chat_submits,
    check_grammar_off_loop,
    collect,
    collect_parsed,
    context_limit,
    engine_run,
    parsed_stream,
)
from services.api.logprobs import chat_logprobs, completion_logprobs
from services.api.output_parsing import Content, Event, OutputParser, Reasoning, ToolCallDelta, ToolCallStart, finish_reason
from services.api.protocol import ChatCompletionRequest, CompletionRequest, Generation, read_body, validate_chat, validate_completion
from services.api.sse import SseWriter
from services.api.state import API_STATE, ApiState
from shared.frames import Submit, TextDelta, TextLogprobs

routes = web.RouteTableDef()

# (choice index, delta) -> the chunks that carry it
ChunkRenderer = Callable[[int, TextDelta], list[dict[str, Any]]]


def usage(prompt_tokens: int, choices: list[ChoiceResult], n: int, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """Prompt tokens count once per prompt, so cached tokens come from each prompt's first sample."""
    completion_tokens = sum(c.completion_tokens for c in choices)
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in choices if c.index % n == 0)},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


async def reasoning_tokens(state: ApiState, parsers: list[OutputParser]) -> int:
    """Tokens spent on reasoning, counted by tokenizing each answer's reasoning text (the engine does not count them)."""
    return sum([await state.prompts.count_tokens(p.reasoning) for p in parsers])


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    state = request.app[API_STATE]
    return web.json_response({"object": "list", "data": [state.model_card()]})


@routes.get("/v1/models/{model}")
async def get_model(request: web.Request) -> web.Response:
    state = request.app[API_STATE]
    name = request.match_info["model"]
    if name != state.model_id:
        raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
    return web.json_response(state.model_card())


def _event_deltas(events: list[Event]) -> list[dict[str, Any]]:
    """A call streams as its id and name first, then its argument fragments (JSON text, complete when concatenated)."""
    deltas: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, Reasoning):
            deltas.append({"reasoning_content": event.text})
        elif isinstance(event, Content):
            deltas.append({"content": event.text})
        elif isinstance(event, ToolCallStart):
            deltas.append({"tool_calls": [{"index": event.index, "id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}}]})
        elif isinstance(event, ToolCallDelta):
            deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]})
    return deltas


def _message(parser: OutputParser) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parser.content if parser.content or not parser.calls else None}
    if parser.reasoning:
        message["reasoning_content"] = parser.reasoning
    if parser.calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parser.calls]
    return message


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[API_STATE]
    body: ChatCompletionRequest = await read_body(request, ChatCompletionRequest)
    generation, turn = validate_chat(body, state.model_id, state.chat_format.efforts, state.model.vocab_size)
    prompt, submits = await chat_submits(state, turn, generation, "messages")
    parsers = [state.chat_format.parser(turn, prompt) for _ in submits]
    envelope = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_id}
    wants_logprobs = generation.sampling.logprobs is not None
    unsent: list[list[TextLogprobs]] = [[] for _ in submits]  # logprobs not yet on a chunk (the parser held their text)

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**envelope, "object": "chat.completion.chunk", "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    async def respond(stream: AsyncIterator[tuple[int, TextDelta]]) -> web.StreamResponse:
        if not generation.stream:
            choices = await collect_parsed(stream, parsers)
            return web.json_response(
                {
                    **envelope,
                    "object": "chat.completion",
                    "choices": [
                        {
                            "index": c.index,
                            "message": _message(p),
                            "logprobs": chat_logprobs(c.logprobs) if wants_logprobs else None,
                            "finish_reason": finish_reason(c.finish_reason or "stop", bool(p.calls)),
                        }
                        for c, p in zip(choices, parsers)
                    ],
                    "usage": usage(len(prompt.ids), choices, generation.n, await reasoning_tokens(state, parsers)),
                }
            )
        events = parsed_stream(stream, parsers)

        def render(index: int, item: tuple[list[Event], TextDelta]) -> list[dict[str, Any]]:
            parsed, delta = item
            out = [chunk(index, d) for d in _event_deltas(parsed)]
            if delta.finish:
                out.append(chunk(index, {}, finish_reason(delta.finish, bool(parsers[index].calls))))
            unsent[index] += delta.logprobs
            if out and unsent[index]:
                out[0]["choices"][0]["logprobs"] = chat_logprobs(unsent[index])
                unsent[index] = []
            return out

        async def final_usage(choices: list[ChoiceResult]) -> dict[str, Any]:
            return usage(len(prompt.ids), choices, generation.n, await reasoning_tokens(state, parsers))

        opening = [chunk(i, {"role": "assistant", "content": ""}) for i in range(len(submits))]
        return await stream_chunks(request, _pairs(events), generation, [len(prompt.ids)], opening, render, final_usage, chunk(0, {}))

    return await _serve(state, submits, respond)


async def _pairs(events: AsyncIterator[tuple[int, list[Event], TextDelta]]) -> AsyncIterator[tuple[int, tuple[list[Event], TextDelta]]]:
    async for index, parsed, delta in events:
        yield index, (parsed, delta)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[API_STATE]
    body: CompletionRequest = await read_body(request, CompletionRequest)
    generation, prompts = validate_completion(body, state.model_id, state.model.vocab_size)
    await check_grammar_off_loop(state, generation.sampling.grammar, generation.grammar_param)
    prompt_ids = [p if isinstance(p, list) else await state.prompts.encode(p) for p in prompts]
    limits = [context_limit(len(ids), generation, state.max_model_len, "prompt") for ids in prompt_ids]
    echoes = [(p if isinstance(p, str) else await state.prompts.decode(p)) if body.echo else "" for p in prompts]
    submits = build_submits(generation, prompt_ids, limits, state.eos_token_ids, state.config.api_address)
    envelope = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": state.model_id}
    echoed: set[int] = set()
    wants_logprobs = generation.sampling.logprobs is not None
    unsent: list[list[TextLogprobs]] = [[] for _ in submits]  # logprobs whose text is held back (an unfinished character)
    offsets = [0] * len(submits)  # text_offset of each choice's next token

    def echo(index: int) -> str:
        if index in echoed:
            return ""
        echoed.add(index)
        return echoes[index // generation.n]

    def chunk(index: int, text: str, finish: str | None) -> dict[str, Any]:
        return {**envelope, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}

    def render(index: int, delta: TextDelta) -> list[dict[str, Any]]:
        out = [chunk(index, echo(index) + delta.text, None)] if delta.text else []
        if delta.finish:
            out.append(chunk(index, echo(index), delta.finish))
        unsent[index] += delta.logprobs
        if out and unsent[index]:
            out[0]["choices"][0]["logprobs"] = completion_logprobs(unsent[index], offsets[index])
            offsets[index] += sum(len(e.chosen.token) for e in unsent[index])
            unsent[index] = []
        return out

    async def final_usage(choices: list[ChoiceResult]) -> dict[str, Any]:
        return usage(sum(len(ids) for ids in prompt_ids), choices, generation.n)

    async def respond(stream: AsyncIterator[tuple[int, TextDelta]]) -> web.StreamResponse:
        if not generation.stream:
            choices = await collect(stream, len(submits))
            return web.json_response(
                {
                    **envelope,
                    "choices": [
                        {
                            "index": c.index,
                            "text": echo(c.index) + c.text,
                            "logprobs": completion_logprobs(c.logprobs) if wants_logprobs else None,
                            "finish_reason": c.finish_reason,
                        }
                        for c in choices
                    ],
                    "usage": await final_usage(choices),
                }
            )
        return await stream_chunks(request, stream, generation, [len(ids) for ids in prompt_ids], [], render, final_usage, chunk(0, "", None))

    return await _serve(state, submits, respond)


async def _serve(
    state: ApiState, submits: list[Submit], respond: Callable[[AsyncIterator[tuple[int, TextDelta]]], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    async with engine_run(state, submits) as stream:
        return await respond(stream)


async def stream_chunks(
    request: web.Request,
    stream: AsyncIterator[tuple[int, Any]],
    generation: Generation,
    prompt_lens: list[int],
    opening: list[dict[str, Any]],
    render: Callable[[int, Any], list[dict[str, Any]]],
    final_usage: Callable[[list[ChoiceResult]], Awaitable[dict[str, Any]]],
    usage_template: dict[str, Any],
) -> web.StreamResponse:
    """Streams OpenAI chunks: ``render`` turns each (choice, item) into chunks; usage as stream_options ask.

    Items are TextDeltas or (events, TextDelta) pairs; the TextDelta carries the counts.
    """
    # Wait for the engine's first answer before sending headers, so that a refusal is a real HTTP status.
    first = await anext(stream, None)
    count = generation.n * len(prompt_lens)
    writer = SseWriter(request, with_usage_field=generation.include_usage or generation.continuous_usage)
    await writer.open()
    choices = [ChoiceResult(index=i) for i in range(count)]

    def usage_so_far(index: int) -> dict[str, Any] | None:
        if not generation.continuous_usage:
            return None
        prompt_tokens = prompt_lens[index // generation.n]
        done = choices[index].completion_tokens
        return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}

    try:
        for payload in opening:
            await writer.send(payload, usage_so_far(payload["choices"][0]["index"]))
        async for index, item in _chain([first] if first is not None else [], stream):
            delta: TextDelta = item[1] if isinstance(item, tuple) else item
            choices[index].completion_tokens = delta.completion_tokens
            if delta.finish:
                choices[index].finish_reason, choices[index].cached_tokens = delta.finish, delta.cached_tokens
            for payload in render(index, item):
                await writer.send(payload, usage_so_far(index))
        if generation.include_usage:
            await writer.send_usage(await final_usage(choices), usage_template)
    except ApiError as exc:
        await writer.send_error(exc.body())
    await writer.close()
    return writer.response


async def _chain(first: list[Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for item in first:
        yield item
    async for item in rest:
        yield item
