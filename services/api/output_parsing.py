"""One answer's text as the protocols present it: reasoning, content and tool calls.

``OutputParser`` chains the reasoning splitter and the tool parser (tool calls are looked
for in the content only, never in the reasoning) and keeps what it has seen, so the
same object serves a stream (its events) and a full answer (its totals).
"""

from __future__ import annotations

import uuid
from typing import NamedTuple

from services.api.reasoning import Content, Reasoning, ReasoningSplitter
from services.api.tool_parsers import CallArgs, CallEnd, CallStart, Piece, ToolParser

__all__ = ["Content", "OutputParser", "Reasoning", "ToolCall", "ToolCallDelta", "ToolCallStart", "Event", "finish_reason"]


class ToolCallStart(NamedTuple):
    """A call begins: its id and name are known, its arguments follow in ``ToolCallDelta`` events."""

    index: int  # among this answer's calls
    id: str
    name: str


class ToolCallDelta(NamedTuple):
    index: int
    arguments: str  # a fragment; a call's fragments concatenate to its ``ToolCall.arguments``


class ToolCall(NamedTuple):
    """A call ends (every started call does): the whole of it."""

    index: int
    id: str
    name: str
    arguments: str  # a JSON object's text


Event = Reasoning | Content | ToolCallStart | ToolCallDelta | ToolCall


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent text pieces of one kind as one piece; adjacent argument fragments of one call as one."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, Reasoning | Content) and type(event) is type(last):
            out[-1] = type(event)(last.text + event.text)  # type: ignore[union-attr]
        elif isinstance(event, ToolCallDelta) and isinstance(last, ToolCallDelta) and last.index == event.index:
            out[-1] = ToolCallDelta(event.index, last.arguments + event.arguments)
        else:
            out.append(event)
    return out


class OutputParser:
    def __init__(self, splitter: ReasoningSplitter | None = None, tools: ToolParser | None = None, id_prefix: str = "call_") -> None:
        self.splitter = splitter
        self.tools = tools
        self.id_prefix = id_prefix
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []
        self.calls: list[ToolCall] = []
        self._open: ToolCallStart | None = None
        self._started = 0
        self._arguments: list[str] = []

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    @property
    def content(self) -> str:
        return "".join(self.content_parts)

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        pieces = self.splitter.feed(text) if self.splitter else [Content(text)]
        return self._through_tools(pieces, final=False)

    def finish(self) -> list[Event]:
        pieces = self.splitter.finish() if self.splitter else []
        return self._through_tools(pieces, final=True)

    def _through_tools(self, pieces: list[Reasoning | Content], final: bool) -> list[Event]:
        events: list[Event] = []
        for piece in pieces:
            if isinstance(piece, Content) and self.tools is not None:
                events += [self._event(p) for p in self.tools.feed(piece.text)]
            else:
                events.append(piece)
        if final and self.tools is not None:
            events += [self._event(p) for p in self.tools.finish()]
        events = _merge(events)
        for event in events:
            if isinstance(event, Reasoning):
                self.reasoning_parts.append(event.text)
            elif isinstance(event, Content):
                self.content_parts.append(event.text)
            elif isinstance(event, ToolCall):
                self.calls.append(event)
        return events

    def _event(self, piece: Piece) -> Event:
        if isinstance(piece, CallStart):
            self._started += 1
            self._open, self._arguments = ToolCallStart(self._started - 1, f"{self.id_prefix}{uuid.uuid4().hex[:24]}", piece.name), []
            return self._open
        if isinstance(piece, CallArgs):
            self._arguments.append(piece.text)
            return ToolCallDelta(self._open.index, piece.text)  # type: ignore[union-attr]
        if isinstance(piece, CallEnd):
            call, self._open = self._open, None
            return ToolCall(call.index, call.id, call.name, "".join(self._arguments))  # type: ignore[union-attr]
        return Content(piece.text)


def finish_reason(engine_finish: str, made_calls: bool) -> str:
    """The engine's ``stop`` becomes ``tool_calls`` when the answer called tools; ``length`` stays ``length``."""
    return "tool_calls" if made_calls and engine_finish == "stop" else engine_finish
