"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API.

Streams carry the named events in Anthropic's order (``message_start``, then per content
block ``content_block_start`` / ``content_block_delta``… / ``content_block_stop``, then
``message_delta`` with the stop reason and ``message_stop``), with a ``ping`` after the
start and whenever the engine is silent for ``ApiState.keepalive_s``. Errors use the
Anthropic shape, as a response or as an ``error`` event mid-stream.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from services.api.anthropic_protocol import CountTokensRequest, MessagesRequest, turn_of, validate_messages
from services.api.errors import ApiError
from services.api.generation import chat_submits, engine_run, parsed_stream
from services.api.output_parsing import Event, OutputParser, Reasoning, ToolCall, ToolCallDelta, ToolCallStart
from services.api.protocol import check_model, read_body
from services.api.sse import EventWriter, with_keepalive
from services.api.state import API_STATE, ApiState
from shared.frames import TextDelta

routes = web.RouteTableDef()

Emitted = tuple[str, dict[str, Any]]  # (event name, payload)


class ContentBuilder:
    """Content blocks (thinking, text, tool_use) from parsed events; ``feed`` returns their stream events."""

    def __init__(self, show_thinking: bool = True) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the thinking or text block being written
        self.show_thinking = show_thinking

    def feed(self, events: list[Event]) -> list[Emitted]:
        out: list[Emitted] = []
        for event in events:
            if isinstance(event, ToolCallStart):
                out += self.close()
                out += self._start({"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
                continue
            if isinstance(event, ToolCallDelta):
                out.append(self._delta({"type": "input_json_delta", "partial_json": event.arguments}))
                continue
            if isinstance(event, ToolCall):
                self.open = {"type": "tool_use", "id": event.id, "name": event.name, "input": json.loads(event.arguments)}
                out += self.close()
                continue
            kind, field, delta_type = ("thinking", "thinking", "thinking_delta") if isinstance(event, Reasoning) else ("text", "text", "text_delta")
            text = event.text if kind == "text" or self.show_thinking else ""
            if self.open is None or self.open["type"] != kind:
                out += self.close()
                out += self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""})
            if text:
                self.open[field] += text  # type: ignore[index]
                out.append(self._delta({"type": delta_type, field: text}))
        return out

    def close(self) -> list[Emitted]:
        if self.open is None:
            return []
        self.blocks.append(self.open)
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def _start(self, block: dict[str, Any]) -> list[Emitted]:
        self.open = block
        return [("content_block_start", {"type": "content_block_start", "index": len(self.blocks), "content_block": dict(block)})]

    def _delta(self, delta: dict[str, Any]) -> Emitted:
        return ("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks), "delta": delta})


def stop_reason(delta: TextDelta, made_calls: bool) -> tuple[str, str | None]:
    """Anthropic's stop reason and the stop sequence that ended the answer (known once the frame reports it)."""
    if delta.finish == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    matched = delta.matched
    return ("stop_sequence", matched) if matched else ("end_turn", None)


async def _usage(state: ApiState, parser: OutputParser, prompt_tokens: int, delta: TextDelta | None) -> dict[str, Any]:
    """``input_tokens`` excludes the prompt tokens read from the prefix cache, as in Anthropic's accounting."""
    cached = delta.cached_tokens if delta else 0
    usage: dict[str, Any] = {
        "input_tokens": prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": delta.completion_tokens if delta else 0,
    }
    if delta is not None and parser.reasoning:
        usage["output_tokens_details"] = {"thinking_tokens": await state.prompts.count_tokens(parser.reasoning)}
    return usage


@routes.post("/v1/messages")
async def create_message(request: web.Request) -> web.StreamResponse:
    state = request.app[API_STATE]
    body: MessagesRequest = await read_body(request, MessagesRequest)
    generation, turn = validate_messages(body, state.model_id, state.chat_format.efforts)
    prompt, submits = await chat_submits(state, turn, generation, "messages")
    parser = state.chat_format.parser(turn, prompt, id_prefix="toolu_")
    show_thinking = not (body.thinking and body.thinking.display == "omitted")
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": state.model_id}
    async with engine_run(state, submits) as stream:
        events = parsed_stream(stream, [parser])
        if generation.stream:
            return await _stream(request, state, events, parser, message, len(prompt.ids), show_thinking)
        builder = ContentBuilder(show_thinking)
        async for _, parsed, delta in events:
            builder.feed(parsed)
            if delta.finish:
                builder.close()
                reason, sequence = stop_reason(delta, bool(parser.calls))
                usage = await _usage(state, parser, len(prompt.ids), delta)
                return web.json_response({**message, "content": builder.blocks, "stop_reason": reason, "stop_sequence": sequence, "usage": usage})
    raise ApiError(500, "the engine ended the request without finishing it")


async def _stream(
    request: web.Request,
    state: ApiState,
    events: AsyncIterator[tuple[int, list[Event], TextDelta]],
    parser: OutputParser,
    message: dict[str, Any],
    prompt_tokens: int,
    show_thinking: bool,
) -> web.StreamResponse:
    first = await anext(events, None)  # a refusal before the first token is still a real HTTP status
    if first is None:
        raise ApiError(500, "the engine ended the request without an answer")
    writer = EventWriter(request)
    await writer.open()
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": await _usage(state, parser, prompt_tokens, None)}
    await writer.send("message_start", {"type": "message_start", "message": start})
    await writer.send("ping", {"type": "ping"})
    builder = ContentBuilder(show_thinking)
    try:
        # Closed here, so its pending read of the engine stream ends before the caller closes that stream.
        async with contextlib.aclosing(with_keepalive(events, state.keepalive_s)) as items:
            async for item in _chain(first, items):
                if item is None:
                    await writer.send("ping", {"type": "ping"})
                    continue
                _, parsed, delta = item
                for name, payload in builder.feed(parsed):
                    await writer.send(name, payload)
                if delta.finish:
                    await _finish(writer, builder, state, parser, prompt_tokens, delta)
    except ApiError as exc:
        await writer.send("error", exc.anthropic_body())
    await writer.close()
    return writer.response


async def _finish(writer: EventWriter, builder: ContentBuilder, state: ApiState, parser: OutputParser, prompt_tokens: int, delta: TextDelta) -> None:
    for name, payload in builder.close():
        await writer.send(name, payload)
    reason, sequence = stop_reason(delta, bool(parser.calls))
    usage = await _usage(state, parser, prompt_tokens, delta)
    await writer.send("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage})
    await writer.send("message_stop", {"type": "message_stop"})


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[API_STATE]
    body: CountTokensRequest = await read_body(request, CountTokensRequest)
    check_model(body.model, state.model_id)
    prompt = await state.chat_format.render(state.prompts, turn_of(body, state.chat_format.efforts))
    return web.json_response({"input_tokens": len(prompt.ids)})
