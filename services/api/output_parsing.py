"""One answer's text as the protocols present it: reasoning, content and tool calls.

``OutputParser`` chains the reasoning splitter and the tool parser (tool calls are looked
for in the content only, never in the reasoning) and keeps what it has seen, so the
same object serves a stream (its events) and a full answer (its totals).
"""

from __future__ import annotations

import uuid
from typing import NamedTuple

from services.api.reasoning import Content, Reasoning, ReasoningSplitter
from services.api.tool_parsers import ParsedCall, ToolParser

__all__ = ["Content", "OutputParser", "Reasoning", "ToolCall", "Event", "finish_reason"]


class ToolCall(NamedTuple):
    index: int  # among this answer's calls
    id: str
    name: str
    arguments: str  # a JSON object's text


Event = Reasoning | Content | ToolCall


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent text pieces of one kind as one piece."""
    out: list[Event] = []
    for event in events:
        if out and type(event) is type(out[-1]) and not isinstance(event, ToolCall):
            out[-1] = type(event)(out[-1].text + event.text)  # type: ignore[union-attr]
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
        self._minted = 0

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
            else:
                self.calls.append(event)
        return events

    def _event(self, piece: object) -> Event:
        if isinstance(piece, ParsedCall):
            self._minted += 1
            return ToolCall(self._minted - 1, f"{self.id_prefix}{uuid.uuid4().hex[:24]}", piece.name, piece.arguments)
        return Content(piece.text)  # type: ignore[attr-defined]


def finish_reason(engine_finish: str, made_calls: bool) -> str:
    """The engine's ``stop`` becomes ``tool_calls`` when the answer called tools; ``length`` stays ``length``."""
    return "tool_calls" if made_calls and engine_finish == "stop" else engine_finish
