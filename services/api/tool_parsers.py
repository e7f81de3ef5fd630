"""Tool-call parsers: find a model family's tool calls in its answer text, incrementally.

Every parser turns text into ``Text`` and ``ParsedCall`` pieces and is chunk-invariant:
fed in any chunks, it yields the same calls and text whose concatenation is the same as
when fed the whole answer. A call is yielded once it is complete and valid (its arguments
a JSON object); anything malformed comes back as the text it was. Parsers are chosen by
name from ``TOOL_PARSERS`` (the ``tool_call_parser`` setting), else by the chat template
and the model family (``choose_tool_parser``).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

from services.api.reasoning import held_prefix
from services.api.tools import ToolSpec


class Text(NamedTuple):
    text: str


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # the text of a JSON object


class ToolParser(ABC):
    """Incremental parser of one answer: ``feed`` each text delta, then ``finish`` once."""

    name: ClassVar[str]

    def __init__(self, tools: list[ToolSpec], parallel: bool = True) -> None:
        self.tools = {tool.name: tool for tool in tools}
        self.parallel = parallel
        self.calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[Text | ParsedCall]: ...

    @abstractmethod
    def finish(self) -> list[Text | ParsedCall]: ...

    def _accept(self, call: ParsedCall, out: list[Text | ParsedCall]) -> None:
        """Counts a valid call; yields it unless parallel calls are off and one came already."""
        self.calls += 1
        if self.parallel or self.calls == 1:
            out.append(call)


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    TOOL_PARSERS[cls.name] = cls
    return cls


def _call_from_object(obj: Any) -> ParsedCall | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` (arguments may be JSON text) as a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class _TaggedParser(ToolParser):
    """Calls framed by tags (``frames``: opening and closing tag pairs); text around them passes through.

    Whitespace next to a call is dropped (before it, between calls, after it), and so is the
    answer's trailing whitespace once it made a call; other text is returned as it came.
    """

    frames: ClassVar[tuple[tuple[str, str], ...]]

    def __init__(self, tools: list[ToolSpec], parallel: bool = True) -> None:
        super().__init__(tools, parallel)
        self.buffer = ""
        self.inside: int | None = None  # index into frames of the open call
        self.scanned = 0  # the open call's buffer holds no closing tag before this offset
        self.held = ""  # trailing whitespace not yet known to be content
        self.strip_leading = False

    @abstractmethod
    def parse(self, opener: str, body: str) -> ParsedCall | None:
        """A call from the text between an opening tag and its closing tag, or None if malformed."""

    def feed(self, text: str) -> list[Text | ParsedCall]:
        self.buffer += text
        out: list[Text | ParsedCall] = []
        while True:
            if self.inside is None:
                hits = [(at, i) for i, (opener, _) in enumerate(self.frames) if (at := self.buffer.find(opener)) >= 0]
                if not hits:
                    keep = max(held_prefix(self.buffer, opener) for opener, _ in self.frames)
                    self._text(self.buffer[: len(self.buffer) - keep], out)
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return out
                at, self.inside = min(hits)
                self._text(self.buffer[:at], out)
                self.buffer = self.buffer[at + len(self.frames[self.inside][0]) :]
            else:
                opener, closer = self.frames[self.inside]
                at = self.buffer.find(closer, self.scanned)
                if at < 0:
                    self.scanned = max(0, len(self.buffer) - len(closer) + 1)
                    return out
                body, self.buffer, self.inside, self.scanned = self.buffer[:at], self.buffer[at + len(closer) :], None, 0
                self._close(opener, body, closer, out)

    def finish(self) -> list[Text | ParsedCall]:
        out: list[Text | ParsedCall] = []
        if self.inside is not None:  # never closed: a call if what came is complete, else text
            opener, body, self.inside = self.frames[self.inside][0], self.buffer, None
            self.buffer, self.scanned = "", 0
            self._close(opener, body, "", out)
        self._text(self.buffer, out)
        self.buffer = ""
        if self.held and not self.calls:
            out.append(Text(self.held))
        self.held = ""
        return out

    def _close(self, opener: str, body: str, closer: str, out: list[Text | ParsedCall]) -> None:
        call = self.parse(opener, body)
        if call is None:
            self._text(opener + body + closer, out)
            return
        self.held, self.strip_leading = "", True
        self._accept(call, out)

    def _text(self, text: str, out: list[Text | ParsedCall]) -> None:
        text = self.held + text
        if self.strip_leading:
            text = text.lstrip()
            if not text:
                self.held = ""
                return
            self.strip_leading = False
        core = text.rstrip()
        self.held = text[len(core) :]
        if core:
            out.append(Text(core))


@register
class HermesParser(_TaggedParser):
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    name = "hermes"
    frames = (("<tool_call>", "</tool_call>"),)

    def parse(self, opener: str, body: str) -> ParsedCall | None:
        try:
            return _call_from_object(json.loads(body))
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting is malformed too
            return None


_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


@register
class Qwen3CoderParser(_TaggedParser):
    """Qwen3-Coder XML: ``<tool_call><function=name><parameter=p>value</parameter></function></tool_call>``.

    Values are raw text, converted by the type the tool's schema declares for the parameter.
    A bare ``<function=…>…</function>`` (without the outer tags) is a call too.
    """

    name = "qwen3_coder"
    frames = (("<tool_call>", "</tool_call>"), ("<function=", "</function>"))

    def parse(self, opener: str, body: str) -> ParsedCall | None:
        if opener == "<tool_call>":
            body = body.strip()
            if not (body.startswith("<function=") and body.endswith("</function>")):
                return None
            body = body[len("<function=") : -len("</function>")]
        name, bracket, rest = body.partition(">")
        name = name.strip()
        if not bracket or not name or "<" in name:
            return None
        arguments: dict[str, Any] = {}
        for match in _PARAMETER.finditer(rest):
            arguments[match.group(1).strip()] = self._value(name, match.group(1).strip(), match.group(2))
        if _PARAMETER.sub("", rest).strip():
            return None  # text outside parameters: not a well-formed call
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))

    def _value(self, function: str, parameter: str, raw: str) -> Any:
        text = raw[1:] if raw.startswith("\n") else raw
        text = text[:-1] if text.endswith("\n") else text
        tool = self.tools.get(function)
        kind = tool.parameter_type(parameter) if tool else None
        if kind == "string":
            return text
        if kind == "boolean" and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return text
        if kind in ("integer", "number") and not isinstance(value, int | float):
            return text
        return value


@register
class Llama3JsonParser(ToolParser):
    """Llama 3.x: the whole answer is one or more ``{"name": ..., "parameters": {...}}`` objects
    (optionally after ``<|python_tag|>``, separated by ``;``). An answer that starts like one
    is held until it ends; if it is not all calls, it is returned as text.
    """

    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def __init__(self, tools: list[ToolSpec], parallel: bool = True) -> None:
        super().__init__(tools, parallel)
        self.buffer = ""
        self.mode = "start"  # "start" | "json" | "text"

    def feed(self, text: str) -> list[Text | ParsedCall]:
        self.buffer += text
        if self.mode == "start":
            head = self.buffer.lstrip()
            if not head or (len(head) < len(self.python_tag) and self.python_tag.startswith(head)):
                return []
            self.mode = "json" if head.startswith(("{", self.python_tag)) else "text"
        if self.mode == "text":
            text, self.buffer = self.buffer, ""
            return [Text(text)] if text else []
        return []

    def finish(self) -> list[Text | ParsedCall]:
        text, self.buffer = self.buffer, ""
        if self.mode != "json":
            return [Text(text)] if text else []
        calls = self._calls(text.strip())
        if calls is None:
            return [Text(text)]
        out: list[Text | ParsedCall] = []
        for call in calls:
            self._accept(call, out)
        return out

    def _calls(self, text: str) -> list[ParsedCall] | None:
        text = text.removeprefix(self.python_tag)
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        while text := text.lstrip().removeprefix(";").lstrip():
            try:
                obj, end = decoder.raw_decode(text)
            except (ValueError, RecursionError):
                return None
            for item in obj if isinstance(obj, list) else [obj]:
                call = _call_from_object(item)
                if call is None:
                    return None
                calls.append(call)
            text = text[end:]
        return calls or None


FAMILY_TOOL_PARSERS = {"qwen2": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes", "qwen3_next": "hermes", "llama": "llama3_json"}
"""The parser a model family's own chat template calls for, when the template shows no clearer sign."""


def renders_tools(chat_template: str) -> bool:
    """Whether a chat template renders tool definitions itself (it reads the ``tools`` variable)."""
    return re.search(r"\btools\b", chat_template) is not None


def choose_tool_parser(setting: str, family: str, chat_template: str) -> str:
    """The parser's name: the setting if given; else the format the template teaches; else the family's.

    A template that renders no tools gets the Hermes prompt from ``tools.fallback_tool_prompt``,
    so its answers are parsed as Hermes.
    """
    if setting:
        if setting != "none" and setting not in TOOL_PARSERS:
            raise ValueError(f"unknown tool_call_parser {setting!r}; choose one of {', '.join(['none', *TOOL_PARSERS])}")
        return setting
    if not renders_tools(chat_template):
        return "hermes"
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return "llama3_json"
    return FAMILY_TOOL_PARSERS.get(family, "hermes")
