"""A JSON object arriving in pieces, re-serialised as it comes: what tool-call arguments stream as.

``JsonStreamer`` emits only text that is final, normalised as ``json.dumps(value,
ensure_ascii=False)`` writes it, so the pieces of a complete object concatenate to exactly
that. A key (and the separator before it) is emitted together with the start of its value,
a number or literal once it ends, so ``close()`` can always finish what was emitted into
valid JSON: it closes an open string and the open containers. Malformed input stops the
streamer (``failed``) at the last valid point.
"""

from __future__ import annotations

import json
import math
import re

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_WHITESPACE = " \t\n\r"


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class JsonStreamer:
    def __init__(self, inside_object: bool = False) -> None:
        """``inside_object``: start as if an object's member was just read (to skip the rest of an object)."""
        self.stack: list[str] = ["}"] if inside_object else []  # closers of the open containers
        self.expect = "sep_or_end" if inside_object else "start"  # start | value | key | colon | sep_or_end | done
        self.first_in_container = False
        self.key = ""  # the member's key (quoted), waiting for its value to start
        self.string: str | None = None  # "key" or "value" while inside a string
        self.escape: str | None = None  # an escape sequence being read, from its backslash
        self.high_surrogate = ""  # a \\uD8xx waiting for its pair
        self.scalar = ""  # a number or literal being read
        self.failed = False
        self.rest = ""  # text after the end of the value

    @property
    def done(self) -> bool:
        return self.expect == "done"

    def feed(self, text: str) -> str:
        out: list[str] = []
        for at, char in enumerate(text):
            if self.failed:
                break
            if self.done:
                self.rest += text[at:]
                break
            self._char(char, out)
        return "".join(out)

    def close(self) -> str:
        """What makes the emitted text valid JSON: a closing quote and the open containers' closers ("{}" if nothing came)."""
        if self.expect == "start":
            self.expect = "done"
            return "{}"
        tail = ""
        if self.string == "value":
            tail += _quoted(self.high_surrogate) if self.high_surrogate else ""
            tail += '"'
        self.string = None
        tail += "".join(reversed(self.stack))
        self.stack, self.expect = [], "done"
        return tail

    # The machine. ---------------------------------------------------------------------

    def _char(self, char: str, out: list[str]) -> None:
        if self.string is not None:
            self._string_char(char, out)
            return
        if self.scalar:
            if char in _NUMBER_CHARS or char.isalpha():
                self.scalar += char
                if self.scalar[0] not in "-0123456789" and not any(lit.startswith(self.scalar) for lit in _LITERALS):
                    self.failed = True
                return
            if not self._end_scalar(out):
                return
        if char in _WHITESPACE:
            return
        expect = self.expect
        if expect == "start":
            if char != "{":
                self.failed = True
                return
            self._open("{", "}", out)
        elif expect == "key":
            if char == '"':
                self.string, self.key = "key", '"'
            elif char == "}" and self.first_in_container:
                self._close_container(out)
            else:
                self.failed = True
        elif expect == "colon":
            if char == ":":
                self.expect = "value"
            else:
                self.failed = True
        elif expect == "value":
            self._value_start(char, out)
        elif expect == "sep_or_end":
            if char == ",":
                self.first_in_container = False
                self.expect = "key" if self.stack[-1] == "}" else "value"
            elif char == self.stack[-1]:
                self._close_container(out)
            else:
                self.failed = True

    def _value_start(self, char: str, out: list[str]) -> None:
        if char == "]" and self.stack and self.stack[-1] == "]" and self.first_in_container:
            self._close_container(out)
        elif char == '"':
            out.append(self._prefix() + '"')
            self.string = "value"
        elif char == "{":
            self._open("{", "}", out)
        elif char == "[":
            self._open("[", "]", out)
        elif char in "-0123456789" or char in "tfn":
            self.scalar = char
        else:
            self.failed = True

    def _prefix(self) -> str:
        """The separator and key that go before the value now starting."""
        prefix = "" if self.first_in_container or not self.stack else ", "
        if self.stack and self.stack[-1] == "}":
            prefix += self.key + ": "
        self.key, self.first_in_container = "", False
        return prefix

    def _open(self, opener: str, closer: str, out: list[str]) -> None:
        out.append(self._prefix() + opener if self.stack else opener)
        self.stack.append(closer)
        self.first_in_container = True
        self.expect = "key" if opener == "{" else "value"

    def _close_container(self, out: list[str]) -> None:
        out.append(self.stack.pop())
        self.first_in_container = False
        self.expect = "sep_or_end" if self.stack else "done"

    def _end_scalar(self, out: list[str]) -> bool:
        token, self.scalar = self.scalar, ""
        if token in _LITERALS:
            text = token
        elif _NUMBER.fullmatch(token):
            value = json.loads(token)
            text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else token
        else:
            self.failed = True
            return False
        out.append(self._prefix() + text)
        self.expect = "sep_or_end"
        return True

    def _string_char(self, char: str, out: list[str]) -> None:
        if self.escape is not None:
            self.escape += char
            if self.escape[1] == "u":
                if len(self.escape) < 6:
                    return
                try:
                    decoded = chr(int(self.escape[2:], 16))
                except ValueError:
                    self.failed = True
                    return
            elif self.escape[1] in _ESCAPES:
                decoded = _ESCAPES[self.escape[1]]
            else:
                self.failed = True
                return
            self.escape = None
            self._decoded(decoded, out)
        elif char == "\\":
            self.escape = "\\"
        elif char == '"':
            self._decoded("", out)
            if self.string == "key":
                self.key += '"'
                self.expect = "colon"
            else:
                out.append('"')
                self.expect = "sep_or_end"
            self.string = None
        elif char < " ":
            self.failed = True  # raw control characters are not allowed in JSON strings
        else:
            self._decoded(char, out)

    def _decoded(self, char: str, out: list[str]) -> None:
        """One decoded character of the string (empty: the string ends); joins surrogate pairs as json.loads does."""
        if self.high_surrogate:
            if char and "\udc00" <= char <= "\udfff":
                char = (self.high_surrogate + char).encode("utf-16", "surrogatepass").decode("utf-16")
            else:
                self._emit_text(_quoted(self.high_surrogate), out)
            self.high_surrogate = ""
        if char and "\ud800" <= char <= "\udbff":
            self.high_surrogate = char
            return
        if char:
            self._emit_text(_quoted(char) if not "\udc00" <= char <= "\udfff" else f"\\u{ord(char):04x}", out)

    def _emit_text(self, text: str, out: list[str]) -> None:
        if self.string == "key":
            self.key += text
        else:
            out.append(text)
