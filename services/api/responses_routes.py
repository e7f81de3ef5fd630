"""POST /v1/responses: the OpenAI Responses API, stateless, answered whole or as its stream of named events.

One ``OutputBuilder`` turns an answer's parsed events into output items (reasoning,
message, function_call) and the stream events that announce them; the full answer is
built by the same code without sending, so a streamed and an unstreamed response agree.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from aiohttp import web

from services.api.chat import ChatTurn
from services.api.errors import ApiError
from services.api.generation import chat_submits, engine_run, parsed_stream
from services.api.logprobs import chat_logprobs
from services.api.output_parsing import Event, OutputParser, Reasoning, ToolCall, ToolCallDelta, ToolCallStart
from services.api.protocol import Generation, read_body
from services.api.responses_protocol import ResponsesRequest, tool_choice_echo, validate_responses
from services.api.sse import EventWriter
from services.api.state import API_STATE, ApiState
from shared.frames import TextDelta, TextLogprobs

routes = web.RouteTableDef()

Emitted = tuple[str, dict[str, Any]]  # (event type, payload without its sequence number)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Output items from parsed events; ``feed`` returns the stream events, ``output`` holds the finished items."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []  # the open message's, when asked for
        self.unsent: list[TextLogprobs] = []  # tokens whose text the parser still holds
        self.open: dict[str, Any] | None = None  # the item being written (reasoning or message)
        self.call: dict[str, Any] | None = None  # the function call being streamed
        self.text = ""

    def feed(self, events: list[Event], logprobs: Sequence[TextLogprobs] = ()) -> list[Emitted]:
        """Logprobs go with the output text their tokens arrive with; tokens that gave only reasoning or a call carry none."""
        out: list[Emitted] = []
        self.unsent += list(logprobs)
        for event in events:
            if isinstance(event, ToolCallStart):
                self.unsent = []
                out += self._close("completed")
                out += self._call_start(event)
                continue
            if isinstance(event, ToolCallDelta):
                ids = {"item_id": self.call["id"], "output_index": len(self.output)}  # type: ignore[index]
                out.append(("response.function_call_arguments.delta", {"type": "response.function_call_arguments.delta", **ids, "delta": event.arguments}))
                continue
            if isinstance(event, ToolCall):
                out += self._call_end(event)
                continue
            kind = "reasoning" if isinstance(event, Reasoning) else "message"
            if self.open is None or self.open["type"] != kind:
                out += self._close("completed")
                out += self._start(kind)
            self.text += event.text
            delta_type = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            payload = {"type": delta_type, "item_id": self.open["id"], "output_index": len(self.output), "content_index": 0, "delta": event.text}  # type: ignore[index]
            if kind == "message":
                payload["logprobs"] = chat_logprobs(self.unsent)["content"]
                self.logprobs += payload["logprobs"]
            self.unsent = []
            out.append((delta_type, payload))
        return out

    def finish(self, status: str) -> list[Emitted]:
        return self._close(status)

    def _start(self, kind: str) -> list[Emitted]:
        if kind == "reasoning":
            self.open = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            self.open = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.text, self.logprobs = "", []
        index = len(self.output)
        return [
            ("response.output_item.added", {"type": "response.output_item.added", "output_index": index, "item": dict(self.open)}),
            (
                "response.content_part.added",
                {"type": "response.content_part.added", "item_id": self.open["id"], "output_index": index, "content_index": 0, "part": part},
            ),
        ]

    def _close(self, status: str) -> list[Emitted]:
        if self.open is None:
            return []
        item, self.open = self.open, None
        index, ids = len(self.output), {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            done = [("response.reasoning_text.done", {"type": "response.reasoning_text.done", **ids, "text": self.text})]
        else:
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}
            done = [("response.output_text.done", {"type": "response.output_text.done", **ids, "text": self.text, "logprobs": self.logprobs})]
        item |= {"content": [part], "status": status}
        self.output.append(item)
        return [
            *done,
            ("response.content_part.done", {"type": "response.content_part.done", **ids, "part": part}),
            ("response.output_item.done", {"type": "response.output_item.done", "output_index": index, "item": item}),
        ]

    def _call_start(self, call: ToolCallStart) -> list[Emitted]:
        self.call = {"id": _id("fc"), "type": "function_call", "call_id": call.id, "name": call.name, "arguments": "", "status": "in_progress"}
        return [("response.output_item.added", {"type": "response.output_item.added", "output_index": len(self.output), "item": dict(self.call)})]

    def _call_end(self, call: ToolCall) -> list[Emitted]:
        index, item = len(self.output), self.call
        ids = {"item_id": item["id"], "output_index": index}  # type: ignore[index]
        done = item | {"arguments": call.arguments, "status": "completed"}  # type: ignore[operator]
        self.output.append(done)
        self.call = None
        return [
            ("response.function_call_arguments.done", {"type": "response.function_call_arguments.done", **ids, "arguments": call.arguments}),
            ("response.output_item.done", {"type": "response.output_item.done", "output_index": index, "item": done}),
        ]


class _Answer:
    """One response's envelope and totals, shared by the streamed and the unstreamed answer."""

    def __init__(self, state: ApiState, body: ResponsesRequest, generation: Generation, turn: ChatTurn, prompt_tokens: int) -> None:
        self.state = state
        self.prompt_tokens = prompt_tokens
        self.envelope = {
            "id": _id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "model": state.model_id,
            "background": False,
            "store": False,  # nothing is stored
            "previous_response_id": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": turn.tool_choice.parallel,
            "temperature": generation.sampling.temperature,
            "top_p": generation.sampling.top_p,
            "tool_choice": tool_choice_echo(turn.tool_choice),
            "tools": [
                {"type": "function", "name": t.name, "description": t.description or None, "parameters": t.parameters, "strict": False} for t in turn.tools
            ],
            "reasoning": {"effort": turn.effort, "summary": body.reasoning.summary if body.reasoning else None},
            "text": {"format": _format_echo(body)},
            "truncation": "disabled",
            "user": body.user,
        }

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {**self.envelope, "status": status, "output": output, "error": error, "incomplete_details": incomplete, "usage": usage}

    async def usage(self, parser: OutputParser, delta: TextDelta) -> dict[str, Any]:
        reasoning = await self.state.prompts.count_tokens(parser.reasoning)
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": delta.cached_tokens},
            "output_tokens": delta.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": self.prompt_tokens + delta.completion_tokens,
        }


def _format_echo(body: ResponsesRequest) -> dict[str, Any]:
    """The text format the response follows, as the client sent it (its unset fields left out)."""
    text_format = body.text.format if body.text is not None else None
    if text_format is None:
        return {"type": "text"}
    return {key: value for key, value in msgspec.structs.asdict(text_format).items() if value is not None}


def _status(finish: str) -> str:
    return "incomplete" if finish == "length" else "completed"


@routes.post("/v1/responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[API_STATE]
    body: ResponsesRequest = await read_body(request, ResponsesRequest)
    generation, turn = validate_responses(body, state.model_id, state.chat_format.efforts)
    prompt, submits = await chat_submits(state, turn, generation, "input")
    parser = state.chat_format.parser(turn, prompt)
    answer = _Answer(state, body, generation, turn, len(prompt.ids))
    async with engine_run(state, submits) as stream:
        events = parsed_stream(stream, [parser])
        if generation.stream:
            return await _stream(request, events, parser, answer)
        builder = OutputBuilder()
        async for _, parsed, delta in events:
            builder.feed(parsed, delta.logprobs)
            if delta.finish:
                builder.finish(_status(delta.finish))
                return web.json_response(answer.response(_status(delta.finish), builder.output, await answer.usage(parser, delta)))
    raise ApiError(500, "the engine ended the request without finishing it")


async def _stream(request: web.Request, events: AsyncIterator[tuple[int, list[Event], TextDelta]], parser: OutputParser, answer: _Answer) -> web.StreamResponse:
    first = await anext(events, None)  # a refusal before the first token is still a real HTTP status
    writer = EventWriter(request, sequence=True)
    await writer.open()
    builder = OutputBuilder()
    for kind in ("response.created", "response.in_progress"):
        await writer.send(kind, {"type": kind, "response": answer.response("in_progress", [])})
    try:
        async for _, parsed, delta in _chain(first, events):
            for kind, payload in builder.feed(parsed, delta.logprobs):
                await writer.send(kind, payload)
            if delta.finish:
                status = _status(delta.finish)
                for kind, payload in builder.finish(status):
                    await writer.send(kind, payload)
                terminal = "response.incomplete" if status == "incomplete" else "response.completed"
                await writer.send(terminal, {"type": terminal, "response": answer.response(status, builder.output, await answer.usage(parser, delta))})
    except ApiError as exc:
        error = {"code": "rate_limit_exceeded" if exc.status == 429 else "server_error", "message": exc.message}
        await writer.send("response.failed", {"type": "response.failed", "response": answer.response("failed", builder.output, error=error)})
    await writer.close()
    return writer.response


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for item in rest:
        yield item
