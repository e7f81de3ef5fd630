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

from services.api.json_stream import JsonStreamer
from services.api.reasoning import held_prefix
from services.api.tools import ToolSpec
from shared.choices import TOOL_PARSER_NAMES


class Text(NamedTuple):
    text: str


class ParsedCall(NamedTuple):
    """A call parsed whole: ``arguments`` is the text of a JSON object."""

    name: str
    arguments: str


class CallStart(NamedTuple):
    name: str


class CallArgs(NamedTuple):
    """A fragment of the open call's arguments; a call's fragments concatenate to a JSON object's text."""

    text: str


class CallEnd(NamedTuple):
    pass


Piece = Text | CallStart | CallArgs | CallEnd


class ToolParser(ABC):
    """Incremental parser of one answer: ``feed`` each text delta, then ``finish`` once.

    A call comes out as ``CallStart``, ``CallArgs`` fragments and ``CallEnd``; every started call ends.
    """

    name: ClassVar[str]

    def __init__(self, tools: list[ToolSpec], parallel: bool = True) -> None:
        self.tools = {tool.name: tool for tool in tools}
        self.parallel = parallel
        self.calls = 0
        self._muted = False  # the open call is dropped: parallel calls are off and one came already

    @abstractmethod
    def feed(self, text: str) -> list[Piece]: ...

    @abstractmethod
    def finish(self) -> list[Piece]: ...

    def _start(self, name: str, out: list[Piece]) -> None:
        self.calls += 1
        self._muted = not self.parallel and self.calls > 1
        if not self._muted:
            out.append(CallStart(name))

    def _args(self, text: str, out: list[Piece]) -> None:
        if text and not self._muted:
            out.append(CallArgs(text))

    def _end(self, out: list[Piece]) -> None:
        if not self._muted:
            out.append(CallEnd())

    def _accept(self, call: ParsedCall, out: list[Piece]) -> None:
        """A call parsed whole, as the same pieces a streamed one gives."""
        self._start(call.name, out)
        self._args(call.arguments, out)
        self._end(out)


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    if cls.name not in TOOL_PARSER_NAMES:
        raise ValueError(f"tool parser {cls.name!r} is not named in TOOL_PARSER_NAMES (shared/choices.py), which the setting's choices read")
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


class _Head(NamedTuple):
    status: str  # "match" | "maybe" (the text may still become a head) | "no"
    name: str = ""
    end: int = 0  # where the arguments' opening brace is


def _scan_head(text: str) -> _Head:
    """Reads ``{"name": "<name>", "arguments": {`` (or ``"parameters"``), whitespace allowed between tokens."""
    at, name = 0, ""
    for step in ("{", '"name"', ":", "string", ",", ('"arguments"', '"parameters"'), ":", "{"):
        while at < len(text) and text[at] in " \t\n\r":
            at += 1
        if at == len(text):
            return _Head("maybe")
        if step == "string":
            close = at + 1
            while close < len(text) and text[close] != '"':
                close += 2 if text[close] == "\\" else 1
            if close >= len(text):
                return _Head("maybe")
            try:
                name = json.loads(text[at : close + 1])
            except ValueError:
                return _Head("no")
            if not isinstance(name, str) or not name:
                return _Head("no")
            at = close + 1
            continue
        if step == "{" and name:  # the arguments' brace: the head ends before it
            return _Head("match", name, at) if text[at] == "{" else _Head("no")
        options = step if isinstance(step, tuple) else (step,)
        rest = text[at:]
        matched = next((o for o in options if rest.startswith(o)), None)
        if matched is None:
            return _Head("maybe") if any(o.startswith(rest) for o in options) else _Head("no")
        at += len(matched)
    return _Head("no")  # unreachable: the last step returns


class _JsonCallBody:
    """One ``{"name": ..., "arguments": {...}}`` object arriving in pieces.

    The call starts once the name and the arguments' opening brace are read; the arguments then
    stream, re-serialised, and malformed or cut-off arguments are closed into valid JSON at the
    end. A body of another shape (keys in another order, arguments as a string) is only held,
    for a whole parse when it ends.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.held = ""  # the text before the call started (all of it, if it never does)
        self.other_shape = False
        self.args: JsonStreamer | None = None
        self.tail: JsonStreamer | None = None  # the rest of the object after the arguments

    @property
    def started(self) -> bool:
        return self.args is not None

    @property
    def ended(self) -> bool:
        """The whole object was read (what follows it is in ``rest``)."""
        return self.tail is not None and self.tail.done

    @property
    def rest(self) -> str:
        return self.tail.rest if self.tail is not None else ""

    def feed(self, text: str, out: list[Piece]) -> None:
        if self.args is None:
            self.held += text
            if self.other_shape:
                return
            head = _scan_head(self.held)
            if head.status != "match":
                self.other_shape = head.status == "no"
                return
            self.parser._start(head.name, out)
            self.args = JsonStreamer()
            text = self.held[head.end :]
        if not self.args.done:
            self.parser._args(self.args.feed(text), out)
            if not self.args.done:
                return
            text, self.tail = self.args.rest, JsonStreamer(inside_object=True)
        if self.tail is not None:
            self.tail.feed(text)

    def close(self, out: list[Piece]) -> bool:
        """Ends a started call (closing arguments cut short); False if it never started."""
        if self.args is None:
            return False
        if not self.args.done:
            self.parser._args(self.args.close(), out)
        self.parser._end(out)
        return True


class _TaggedParser(ToolParser):
    """Calls framed by tags (``frames``: opening and closing tag pairs); text around them passes through.

    Whitespace next to a call is dropped (before it, between calls, after it), and so is the
    answer's trailing whitespace once it made a call; other text is returned as it came. A call's
    body streams through ``body()``; one that never started is parsed whole at its closing tag,
    and comes back as the text it was if it is malformed.
    """

    frames: ClassVar[tuple[tuple[str, str], ...]]

    def __init__(self, tools: list[ToolSpec], parallel: bool = True) -> None:
        super().__init__(tools, parallel)
        self.buffer = ""
        self.inside: int | None = None  # index into frames of the open call
        self.call: Any = None  # the open call's body
        self.held = ""  # trailing whitespace not yet known to be content
        self.strip_leading = False

    @abstractmethod
    def body(self, opener: str) -> Any:
        """A streaming body parser (``feed(text, out)``, ``close(out) -> started``, ``held``) for the call that ``opener`` opened."""

    @abstractmethod
    def parse(self, opener: str, body: str) -> ParsedCall | None:
        """A call from the text between an opening tag and its closing tag, or None if malformed."""

    def _start(self, name: str, out: list[Piece]) -> None:
        self.held = ""  # whitespace before a call is not content
        super()._start(name, out)

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
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
                self.call = self.body(self.frames[self.inside][0])
            else:
                opener, closer = self.frames[self.inside]
                at = self.buffer.find(closer)
                if at < 0:  # the body streams on, short of what may be the start of the closing tag
                    keep = held_prefix(self.buffer, closer)
                    self.call.feed(self.buffer[: len(self.buffer) - keep], out)
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return out
                self.call.feed(self.buffer[:at], out)
                self.buffer = self.buffer[at + len(closer) :]
                self._close(opener, closer, out)

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.inside is not None:  # never closed: a call if it started or what came is complete, else text
            self.call.feed(self.buffer, out)
            self.buffer = ""
            self._close(self.frames[self.inside][0], "", out)
        self._text(self.buffer, out)
        self.buffer = ""
        if self.held and not self.calls:
            out.append(Text(self.held))
        self.held = ""
        return out

    def _close(self, opener: str, closer: str, out: list[Piece]) -> None:
        call, self.call, self.inside = self.call, None, None
        if not call.close(out):
            parsed = self.parse(opener, call.held)
            if parsed is None:
                self._text(opener + call.held + closer, out)
                return
            self._accept(parsed, out)
        self.held, self.strip_leading = "", True

    def _text(self, text: str, out: list[Piece]) -> None:
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

    def body(self, opener: str) -> _JsonCallBody:
        return _JsonCallBody(self)

    def parse(self, opener: str, body: str) -> ParsedCall | None:
        try:
            return _call_from_object(json.loads(body))
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting is malformed too
            return None


_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_FUNCTION, _PARAM_OPEN, _PARAM_CLOSE, _FUNCTION_CLOSE = "<function=", "<parameter=", "</parameter>", "</function>"


class _XmlCallBody:
    """One Qwen3-Coder ``<function=name>…</function>`` arriving in pieces.

    The call starts once ``<function=name>`` is read: its arguments open with ``{`` and each
    parameter streams as a ``"name": value`` member once its closing tag came (values need the
    schema's type, so they go whole). Text between parameters is dropped; a parameter left open
    by ``</function>`` or the end of the answer keeps the text it has.
    """

    def __init__(self, parser: Qwen3CoderParser, bare: bool) -> None:
        self.parser = parser
        self.bare = bare  # opened by ``<function=`` itself (the name comes first)
        self.held = ""
        self.other_shape = False
        self.name: str | None = None
        self.text = ""  # unread text after the function tag
        self.param: str | None = None  # the open parameter's name
        self.members = 0
        self.function_done = False

    def feed(self, text: str, out: list[Piece]) -> None:
        if self.name is None:
            self.held += text
            if self.other_shape or not self._head(out):
                return
        else:
            self.text += text
        self._parameters(out)

    def _head(self, out: list[Piece]) -> bool:
        head = self.held if self.bare else self.held.lstrip()
        if not self.bare:
            if not head.startswith(_FUNCTION):
                self.other_shape = not _FUNCTION.startswith(head)
                return False
            head = head[len(_FUNCTION) :]
        name, bracket, rest = head.partition(">")
        if not bracket:
            self.other_shape = "<" in name or "\n" in name
            return False
        if not name.strip() or "<" in name:
            self.other_shape = True
            return False
        self.name, self.text = name.strip(), rest
        self.parser._start(self.name, out)
        self.parser._args("{", out)
        return True

    def _parameters(self, out: list[Piece]) -> None:
        while not self.function_done:
            if self.param is None:
                opened, ended = self.text.find(_PARAM_OPEN), self.text.find(_FUNCTION_CLOSE)
                if ended >= 0 and (opened < 0 or ended < opened):
                    self.function_done, self.text = True, ""
                    return
                bracket = self.text.find(">", opened) if opened >= 0 else -1
                if bracket < 0:  # keep only what may still hold a tag
                    keep = len(_FUNCTION_CLOSE) - 1 if opened < 0 else len(self.text) - opened
                    self.text = self.text[len(self.text) - keep :] if keep < len(self.text) else self.text
                    return
                self.param, self.text = self.text[opened + len(_PARAM_OPEN) : bracket].strip(), self.text[bracket + 1 :]
            else:
                closed, ended = self.text.find(_PARAM_CLOSE), self.text.find(_FUNCTION_CLOSE)
                if closed < 0 and ended < 0:
                    return
                at, tag = (closed, _PARAM_CLOSE) if closed >= 0 and (ended < 0 or closed < ended) else (ended, _FUNCTION_CLOSE)
                self._member(self.text[:at], out)
                self.text = self.text[at + len(tag) :]
                self.function_done = tag == _FUNCTION_CLOSE

    def _member(self, raw: str, out: list[Piece]) -> None:
        name, self.param = self.param, None
        if not name or "\n" in name:
            return
        value = self.parser._value(self.name or "", name, raw)
        separator = ", " if self.members else ""
        self.members += 1
        self.parser._args(f"{separator}{json.dumps(name, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}", out)

    def close(self, out: list[Piece]) -> bool:
        if self.name is None:
            return False
        if self.param is not None and not self.function_done:
            self._member(self.text, out)
        self.parser._args("}", out)
        self.parser._end(out)
        return True


@register
class Qwen3CoderParser(_TaggedParser):
    """Qwen3-Coder XML: ``<tool_call><function=name><parameter=p>value</parameter></function></tool_call>``.

    Values are raw text, converted by the type the tool's schema declares for the parameter.
    A bare ``<function=…>…</function>`` (without the outer tags) is a call too.
    """

    name = "qwen3_coder"
    frames = (("<tool_call>", "</tool_call>"), ("<function=", "</function>"))

    def body(self, opener: str) -> _XmlCallBody:
        return _XmlCallBody(self, bare=opener == "<function=")

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
    """Llama 3.x: the answer is one or more ``{"name": ..., "parameters": {...}}`` objects (optionally
    after ``<|python_tag|>``, separated by ``;``), which stream like Hermes calls. An answer that
    does not open with a call is text; one that opens like a call of another shape is held to its
    end and is all calls or all text; text after streamed calls is text.
    """

    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def __init__(self, tools: list[ToolSpec], parallel: bool = True) -> None:
        super().__init__(tools, parallel)
        self.buffer = ""
        self.mode = "start"  # "start" | "calls" (streaming) | "whole" (held to the end) | "text"
        self.call: _JsonCallBody | None = None
        self.opening = ""  # the whitespace and python tag before the first call, for an answer that turns out to be text

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        if self.mode == "start":
            head = self.buffer.lstrip()
            if not head or (len(head) < len(self.python_tag) and self.python_tag.startswith(head)):
                return out
            self.mode = "calls" if head.startswith(("{", self.python_tag)) else "text"
            if self.mode == "calls":
                stripped = head.removeprefix(self.python_tag)
                self.opening, self.buffer = self.buffer[: len(self.buffer) - len(stripped)], stripped
        if self.mode == "calls":
            self._stream(out)
        if self.mode == "text" and self.buffer:
            out.append(Text(self.buffer))
            self.buffer = ""
        return out

    def _stream(self, out: list[Piece]) -> None:
        while self.mode == "calls":
            if self.call is None:
                self.buffer = self.buffer.lstrip(" \t\n\r;")
                if not self.buffer:
                    return
                if not self.buffer.startswith("{"):
                    self.mode = "text" if self.calls else "whole"
                    return
                self.call = _JsonCallBody(self)
            text, self.buffer = self.buffer, ""
            self.call.feed(text, out)
            if self.call.other_shape:
                self.mode, self.buffer, self.call = "whole", self.call.held, None
            elif self.call.ended or (self.call.tail is not None and self.call.tail.failed):
                self.call.close(out)
                self.buffer, self.call = self.call.rest, None
            else:
                return

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.call is not None:
            if not self.call.close(out):  # cut off before its arguments began
                self.mode, self.buffer = "whole", self.call.held + self.buffer
            self.call = None
        text, self.buffer = self.buffer, ""
        if self.mode != "whole":
            return out + ([Text(text)] if text.strip() or (text and not self.calls) else [])
        calls = self._calls(text.strip())
        if calls is None:
            return out + [Text(text if self.calls else self.opening + text)]
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
