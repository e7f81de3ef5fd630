"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from aiohttp import web

from services.api.errors import ApiError, from_validation_error
from services.api.generation import ChoiceResult, build_submits, collect, context_limit, merged_stream
from services.api.metrics import IN_FLIGHT
from services.api.protocol import ChatCompletionRequest, CompletionRequest, Generation, decode_body, validate_chat, validate_completion
from services.api.sse import SseWriter
from services.api.state import ApiState
from shared.frames import TextDelta

routes = web.RouteTableDef()

# (choice index, text or None, finish reason) -> one streamed chunk
ChunkMaker = Callable[[int, str | None, str | None], dict[str, Any]]


async def _read_body(request: web.Request, kind: type) -> Any:
    body = await request.read()
    try:
        return decode_body(body, kind)
    except msgspec.MsgspecError as exc:
        raise from_validation_error(exc) from exc


def _usage(prompt_tokens: int, choices: list[ChoiceResult], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt, so cached tokens come from each prompt's first sample."""
    completion_tokens = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in choices if c.index % n == 0)},
    }


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    state: ApiState = request.app["state"]
    return web.json_response({"object": "list", "data": [state.model_card()]})


@routes.get("/v1/models/{model}")
async def get_model(request: web.Request) -> web.Response:
    state: ApiState = request.app["state"]
    name = request.match_info["model"]
    if name != state.model_id:
        raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
    return web.json_response(state.model_card())


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state: ApiState = request.app["state"]
    body: ChatCompletionRequest = await _read_body(request, ChatCompletionRequest)
    generation, messages = validate_chat(body, state.model_id)
    prompt_ids = await state.prompts.chat(messages, body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs or {})
    max_tokens = context_limit(len(prompt_ids), generation, state.max_model_len, "messages")
    response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    envelope = {"id": response_id, "created": created, "model": state.model_id}

    def chunk(index: int, text: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        delta = {} if text is None else {"role": "assistant", "content": text} if role else {"content": text}
        return {**envelope, "object": "chat.completion.chunk", "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    def final(choices: list[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            **envelope,
            "object": "chat.completion",
            "choices": [
                {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": None, "finish_reason": c.finish_reason} for c in choices
            ],
            "usage": usage,
        }

    opening = [chunk(i, "", None, role=True) for i in range(generation.n)]
    return await _serve(request, state, generation, [prompt_ids], [max_tokens], chunk, final, opening)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    state: ApiState = request.app["state"]
    body: CompletionRequest = await _read_body(request, CompletionRequest)
    generation, prompts = validate_completion(body, state.model_id, state.model.vocab_size)
    prompt_ids = [p if isinstance(p, list) else await state.prompts.encode(p) for p in prompts]
    limits = [context_limit(len(ids), generation, state.max_model_len, "prompt") for ids in prompt_ids]
    echoes = [(p if isinstance(p, str) else await state.prompts.decode(p)) if body.echo else "" for p in prompts]
    response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    envelope = {"id": response_id, "object": "text_completion", "created": created, "model": state.model_id}
    echoed: set[int] = set()

    def echo(index: int) -> str:
        if index in echoed:
            return ""
        echoed.add(index)
        return echoes[index // generation.n]

    def chunk(index: int, text: str | None, finish_reason: str | None) -> dict[str, Any]:
        text = "" if text is None else echo(index) + text
        return {**envelope, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

    def final(choices: list[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            **envelope,
            "choices": [{"index": c.index, "text": echo(c.index) + c.text, "logprobs": None, "finish_reason": c.finish_reason} for c in choices],
            "usage": usage,
        }

    return await _serve(request, state, generation, prompt_ids, limits, chunk, final, opening=[])


async def _serve(
    request: web.Request,
    state: ApiState,
    generation: Generation,
    prompt_ids: list[list[int]],
    max_tokens: list[int],
    chunk: ChunkMaker,
    final: Callable[[list[ChoiceResult], dict[str, Any]], dict[str, Any]],
    opening: list[dict[str, Any]],
) -> web.StreamResponse:
    submits = build_submits(generation, prompt_ids, max_tokens, state.eos_token_ids, state.config.api_replica)
    prompt_tokens = sum(len(ids) for ids in prompt_ids)
    stream = merged_stream(state.engine, submits, state.model_id)
    IN_FLIGHT.labels(state.model_id).inc()
    try:
        if not generation.stream:
            choices = await collect(stream, len(submits))
            return web.json_response(final(choices, _usage(prompt_tokens, choices, generation.n)))
        return await _stream(request, stream, len(submits), generation, prompt_tokens, chunk, opening)
    finally:
        IN_FLIGHT.labels(state.model_id).dec()
        await stream.aclose()


async def _stream(
    request: web.Request,
    stream: AsyncIterator[tuple[int, TextDelta]],
    count: int,
    generation: Generation,
    prompt_tokens: int,
    chunk: ChunkMaker,
    opening: list[dict[str, Any]],
) -> web.StreamResponse:
    # Wait for the engine's first answer before sending headers, so that a refusal is a real HTTP status.
    first = await anext(stream, None)
    writer = SseWriter(request, with_usage_field=generation.include_usage)
    await writer.open()
    choices = [ChoiceResult(index=i) for i in range(count)]
    try:
        for payload in opening:
            await writer.send(payload)
        pending = [first] if first is not None else []
        async for item in _chain(pending, stream):
            index, delta = item
            if delta.text:
                await writer.send(chunk(index, delta.text, None))
            if delta.finish:
                choices[index].completion_tokens, choices[index].cached_tokens = delta.completion_tokens, delta.cached_tokens
                await writer.send(chunk(index, None, delta.finish))
        if generation.include_usage:
            await writer.send_usage(_usage(prompt_tokens, choices, generation.n), chunk(0, None, None))
    except ApiError as exc:
        await writer.send_error(exc.body())
    await writer.close()
    return writer.response


async def _chain(first: list[Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for item in first:
        yield item
    async for item in rest:
        yield item
