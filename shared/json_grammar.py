"""JSON output held to a JSON Schema byte by byte: the grammar that structured outputs (``response_format``
``json_object`` / ``json_schema``) decode under. The api compiles a request's schema to refuse what is outside
the subset below; the worker follows each constrained output through it, one sampled token at a time.

``JsonGrammar(schema, prefix, suffix)`` compiles a schema into nodes (with literal text around the value: a tool
call's tags). A ``Matcher`` holds where an output is as a set of parser
stacks (``anyOf``, type lists and enums fork them; a branch that cannot take the next byte dies), each stack a
linked list of immutable frames, so trying a token copies nothing. The output is one JSON value with at most
``MAX_WHITESPACE`` whitespace bytes in a row, at most ``MAX_DEPTH`` objects and arrays open at once, and nothing
after it: a model cannot pad forever.

The subset: ``type`` (one or a list), ``properties``, ``required``, ``additionalProperties``, ``items``,
``minItems`` / ``maxItems``, ``minLength`` / ``maxLength``, ``enum``, ``const``, ``anyOf`` / ``oneOf`` (both as
any-of), a one-schema ``allOf``, local ``$ref`` into ``$defs`` / ``definitions``, and Gemini's
``propertyOrdering`` (here: every property, in that order). An object schema with ``properties`` and no
``additionalProperties`` takes no other members (as OpenAI's strict mode and xgrammar do); one without
``properties`` takes any. ``format`` and annotations are not enforced; other validation keywords
(``pattern``, ``minimum``, ...) are refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MAX_WHITESPACE = 16  # whitespace bytes in a row between tokens of the value
MAX_NUMBER = 32  # bytes of one number
MAX_KEY = 256  # bytes of one member name the schema does not name
MAX_DEPTH = 64  # objects and arrays open at once: a stack's frames are hashed recursively

_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly", "format", "$defs", "definitions"}
)
_KEYWORDS = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "minLength", "maxLength", "enum", "const"}
    | {"anyOf", "oneOf", "allOf", "$ref", "nullable", "strict", "propertyOrdering"}
)
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_WHITESPACE = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')


class SchemaError(ValueError):
    """A schema outside the subset, with the keyword and where it sits."""


# Nodes: what one JSON value may be.
@dataclass(frozen=True)
class _Object:
    properties: dict[bytes, int]  # member name, JSON-escaped without its quotes -> node
    required: frozenset[bytes]
    additional: int | None  # node of other members; None: no other members
    ordered: bool = False  # the members come in the order of ``properties`` (all of them, no others)

    def next_names(self, seen: frozenset[bytes]) -> list[bytes]:
        """The schema's names a member may take next (other members aside, when allowed)."""
        unseen = [name for name in self.properties if name not in seen]
        return unseen[:1] if self.ordered else unseen


@dataclass(frozen=True)
class _Array:
    items: int
    min_items: int
    max_items: int | None


@dataclass(frozen=True)
class _String:
    min_length: int
    max_length: int | None

    @property
    def counted(self) -> bool:
        return self.min_length > 0 or self.max_length is not None


@dataclass(frozen=True)
class _Number:
    integer: bool


@dataclass(frozen=True)
class _Literals:  # enum, const, boolean, null: the value's exact bytes, one of these
    options: tuple[bytes, ...]


@dataclass(frozen=True)
class _Union:
    alternatives: tuple[int, ...]


_Node = _Object | _Array | _String | _Number | _Literals | _Union

# Frames: what a stack expects next. A stack is (frame, parent stack); None is the empty stack, whose value is complete.
_VALUE, _OBJECT_OPEN, _KEY, _COLON, _OBJECT_NEXT, _OBJECT_COMMA, _ARRAY_OPEN, _ARRAY_NEXT, _STRING, _NUMBER, _LITERAL = range(11)
# Number lexer: after '-', after a leading 0, in integer digits, after '.', in fraction digits, after 'e', after its sign, in exponent digits
_NUMBER_END = frozenset("zifx")


class JsonGrammar:
    """A compiled schema (``True`` or ``{}``: any JSON value). Raises ``SchemaError`` naming what it does not take."""

    def __init__(self, schema: Any, prefix: bytes = b"", suffix: bytes = b"") -> None:
        """``prefix`` and ``suffix``: literal text the output holds before and after the value (a tool call's tags)."""
        self.prefix, self.suffix = prefix, suffix
        self.nodes: list[_Node] = []
        self._root_schema = schema
        self._compiled: dict[int, int] = {}  # id(schema dict) -> node, so $ref cycles compile once
        self.any = self._any()
        self.root = self._compile(schema, "")

    @classmethod
    def json_object(cls) -> JsonGrammar:
        """``response_format: {"type": "json_object"}``: any JSON object."""
        return cls({"type": "object"})

    def start(self) -> Matcher:
        stack: Any = ((_LITERAL, (self.suffix,), 0), None) if self.suffix else None
        stack = ((_VALUE, self.root, 0), stack)
        if self.prefix:
            stack = ((_LITERAL, (self.prefix,), 0), stack)
        return Matcher(self, (stack,))

    # compiling
    def _add(self, node: _Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def _any(self) -> int:
        any_node = self._add(_Union(()))  # filled below: it holds itself in objects and arrays
        members = (
            self._add(_Object({}, frozenset(), any_node)),
            self._add(_Array(any_node, 0, None)),
            self._add(_String(0, None)),
            self._add(_Number(False)),
            self._add(_Literals((b"true", b"false", b"null"))),
        )
        self.nodes[any_node] = _Union(members)
        return any_node

    def _compile(self, schema: Any, where: str) -> int:
        if schema is True or schema == {}:
            return self.any
        if not isinstance(schema, dict):
            raise SchemaError(f"the schema at '{where or '/'}' must be an object or true, not {json.dumps(schema)[:40]}")
        if id(schema) in self._compiled:
            return self._compiled[id(schema)]
        for keyword in schema:
            if keyword not in _KEYWORDS and keyword not in _ANNOTATIONS:
                raise SchemaError(f"the schema keyword '{keyword}' (at '{where or '/'}') is not supported in structured outputs")
        if "$ref" in schema:
            return self._compile(self._resolve(schema["$ref"], where), where)
        slot = self._compiled[id(schema)] = self._add(_Union(()))  # a placeholder a recursive $ref can point at
        self.nodes[slot] = self.nodes[self._compile_body(schema, where)]
        return slot

    def _compile_body(self, schema: dict, where: str) -> int:
        if "const" in schema:
            return self._add(_Literals((_dump(schema["const"]),)))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"'enum' at '{where or '/'}' must be a non-empty list")
            return self._add(_Literals(tuple(dict.fromkeys(_dump(v) for v in values))))
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                options = schema[keyword]
                if not isinstance(options, list) or not options:
                    raise SchemaError(f"'{keyword}' at '{where or '/'}' must be a non-empty list")
                return self._add(_Union(tuple(self._compile(option, f"{where}/{keyword}/{i}") for i, option in enumerate(options))))
        if "allOf" in schema:
            options = schema["allOf"]
            if not isinstance(options, list) or len(options) != 1:
                raise SchemaError(f"'allOf' at '{where or '/'}' is supported with one schema only")
            return self._compile(options[0], f"{where}/allOf/0")
        types = schema.get("type")
        if types is None:
            types = [t for t in _TYPES if t != "integer"] if not any(k in schema for k in ("properties", "items")) else []
            types += ["object"] if "properties" in schema else []
            types += ["array"] if "items" in schema else []
        types = [types] if isinstance(types, str) else list(types)
        if schema.get("nullable") is True and "null" not in types:
            types.append("null")
        for t in types:
            if t not in _TYPES:
                raise SchemaError(f"'type' at '{where or '/'}' names {t!r}; the JSON types are {', '.join(_TYPES)}")
        if not types:
            raise SchemaError(f"the schema at '{where or '/'}' allows no type")
        nodes = [self._typed(t, schema, where) for t in dict.fromkeys(types)]
        return nodes[0] if len(nodes) == 1 else self._add(_Union(tuple(nodes)))

    def _typed(self, kind: str, schema: dict, where: str) -> int:
        if kind == "object":
            properties = schema.get("properties") or {}
            if not isinstance(properties, dict):
                raise SchemaError(f"'properties' at '{where or '/'}' must be an object")
            compiled = {_dump(name)[1:-1]: self._compile(sub, f"{where}/properties/{name}") for name, sub in properties.items()}
            additional = schema.get("additionalProperties", None if properties else True)
            extra = None if additional in (None, False) else self._compile(additional, f"{where}/additionalProperties")
            required = schema.get("required") or []
            missing = [name for name in required if name not in properties]
            if missing and extra is None:
                raise SchemaError(f"'required' at '{where or '/'}' names {missing[0]!r}, which 'properties' does not define")
            ordering = schema.get("propertyOrdering")
            if ordering is not None:  # Gemini's keyword; here: every property, in this order, and no others
                if ordering != list(properties) or extra is not None:
                    raise SchemaError(f"'propertyOrdering' at '{where or '/'}' must list every property in order, with no additionalProperties")
                required = list(properties)
            return self._add(_Object(compiled, frozenset(_dump(name)[1:-1] for name in required), extra, ordering is not None))
        if kind == "array":
            if "prefixItems" in schema:
                raise SchemaError(f"the schema keyword 'prefixItems' (at '{where or '/'}') is not supported in structured outputs")
            items = self._compile(schema.get("items", True), f"{where}/items")
            return self._add(_Array(items, _count(schema, "minItems", where) or 0, _count(schema, "maxItems", where)))
        if kind == "string":
            return self._add(_String(_count(schema, "minLength", where) or 0, _count(schema, "maxLength", where)))
        if kind in ("number", "integer"):
            return self._add(_Number(kind == "integer"))
        return self._add(_Literals((b"true", b"false") if kind == "boolean" else (b"null",)))

    def _resolve(self, ref: Any, where: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"'$ref' at '{where or '/'}' must point into this schema ('#/$defs/...'), not {ref!r}")
        target = self._root_schema
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"'$ref' at '{where or '/'}' points at {ref!r}, which is not in the schema")
            target = target[part]
        return target


def _dump(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _count(schema: dict, keyword: str, where: str) -> int | None:
    value = schema.get(keyword)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise SchemaError(f"'{keyword}' at '{where or '/'}' must be a non-negative integer")
    return value


class Matcher:
    """Where one output is in a grammar: immutable; ``feed`` answers the matcher after some bytes, or None."""

    __slots__ = ("grammar", "stacks")

    def __init__(self, grammar: JsonGrammar, stacks: tuple) -> None:
        self.grammar = grammar
        self.stacks = stacks

    @property
    def complete(self) -> bool:
        """The output is a whole value: it may end here."""
        return None in self.stacks

    @property
    def finished(self) -> bool:
        """The output is a whole value and nothing may follow: only the end of the output is left."""
        return self.stacks == (None,)

    @property
    def in_plain_string(self) -> bool:
        """Every branch is inside a string of unlimited length, past any escape: any bytes without a quote,
        a backslash or a control character keep every branch where it is."""
        return all(s is not None and s[0][0] == _STRING and s[0][3] == 0 and s[0][2] is None for s in self.stacks)

    def feed(self, data: Iterable[int]) -> Matcher | None:
        stacks = self.stacks
        nodes = self.grammar.nodes
        for byte in data:
            following: dict = {}
            for stack in stacks:
                if stack is not None:
                    for after in _step(nodes, stack, byte):
                        following[after] = None
            if not following:
                return None
            stacks = tuple(following)
        return Matcher(self.grammar, stacks)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Matcher) and other.grammar is self.grammar and set(other.stacks) == set(self.stacks)

    def __hash__(self) -> int:
        return hash(frozenset(self.stacks))


def _start(nodes: list[_Node], node_id: int, byte: int, parent: Any) -> list:
    """The stacks after ``byte`` opens a value of ``node_id`` whose completion returns to ``parent``."""
    node = nodes[node_id]
    if isinstance(node, _Union):
        return [s for alternative in node.alternatives for s in _start(nodes, alternative, byte, parent)]
    if isinstance(node, _Object):
        return [((_OBJECT_OPEN, node_id, frozenset(), 0), parent)] if byte == 0x7B and _depth(parent) < MAX_DEPTH else []  # {
    if isinstance(node, _Array):
        return [((_ARRAY_OPEN, node_id, 0), parent)] if byte == 0x5B and _depth(parent) < MAX_DEPTH else []  # [
    if isinstance(node, _String):
        return [((_STRING, node_id, 0 if node.counted else None, 0), parent)] if byte == 0x22 else []
    if isinstance(node, _Number):
        state = "m" if byte == 0x2D else "z" if byte == 0x30 else "i" if byte in _DIGITS else None
        if state is None:
            return []
        number = ((_NUMBER, node_id, state, 1), parent)
        return [number, parent] if state in _NUMBER_END else [number]
    return _literal(node.options, 0, byte, parent)


def _depth(stack: Any) -> int:
    """Objects and arrays open in ``stack`` (each leaves one continuation frame below its members)."""
    depth = 0
    while stack is not None:
        depth += stack[0][0] in (_OBJECT_NEXT, _ARRAY_NEXT)
        stack = stack[1]
    return depth


def _literal(options: tuple[bytes, ...], position: int, byte: int, parent: Any) -> list:
    matching = [o for o in options if len(o) > position and o[position] == byte]
    longer = tuple(o for o in matching if len(o) > position + 1)
    out = [((_LITERAL, longer, position + 1), parent)] if longer else []
    return out + [parent] if len(longer) < len(matching) else out


def _string_byte(escape: int, byte: int) -> int:
    """The state after ``byte`` inside a string: 0 between characters, 1 after a backslash, 2-5 in a \\uXXXX,
    6-8 owing 1-3 UTF-8 continuation bytes; -1: refused (a quote ends the string before this is asked)."""
    if escape == 0:
        if byte < 0x80:
            return 1 if byte == 0x5C else -1 if byte < 0x20 else 0
        return 6 if 0xC2 <= byte <= 0xDF else 7 if 0xE0 <= byte <= 0xEF else 8 if 0xF0 <= byte <= 0xF4 else -1
    if escape >= 6:
        return (escape - 1 if escape > 6 else 0) if 0x80 <= byte <= 0xBF else -1
    if escape == 1:
        return 0 if byte in _ESCAPES else 2 if byte == 0x75 else -1
    return (escape + 1 if escape < 5 else 0) if byte in _HEX else -1


def plain_string_bytes(data: bytes) -> bool:
    """Whether ``data`` may stand anywhere inside a string of unlimited length, between characters: no quote,
    backslash or control character, and well-formed UTF-8 (it may end inside a character)."""
    escape = 0
    for byte in data:
        if byte == 0x22 or byte == 0x5C or (escape := _string_byte(escape, byte)) < 0:
            return False
    return True


def _can_add_member(node: _Object, seen: frozenset[bytes]) -> bool:
    return node.additional is not None or bool(node.next_names(seen))


def _step(nodes: list[_Node], stack: tuple, byte: int) -> list:
    """The stacks ``stack`` becomes after ``byte`` (none: refused)."""
    frame, parent = stack
    kind = frame[0]
    if kind == _VALUE:
        if byte in _WHITESPACE:
            return [((_VALUE, frame[1], frame[2] + 1), parent)] if frame[2] < MAX_WHITESPACE else []
        return _start(nodes, frame[1], byte, parent)
    if kind in (_OBJECT_OPEN, _OBJECT_NEXT, _OBJECT_COMMA):
        _, node_id, seen, spaces = frame
        if byte in _WHITESPACE:
            return [((kind, node_id, seen, spaces + 1), parent)] if spaces < MAX_WHITESPACE else []
        node = nodes[node_id]
        if byte == 0x22 and kind != _OBJECT_NEXT and _can_add_member(node, seen):  # "
            return [((_KEY, node_id, seen, b"", 0), parent)]
        if byte == 0x7D and kind != _OBJECT_COMMA and node.required <= seen:  # }
            return [parent]
        if byte == 0x2C and kind == _OBJECT_NEXT and _can_add_member(node, seen):  # ,
            return [((_OBJECT_COMMA, node_id, seen, 0), parent)]
        return []
    if kind == _KEY:
        _, node_id, seen, key, escape = frame
        node = nodes[node_id]
        if byte == 0x22 and escape == 0:
            known = key in (node.next_names(seen) if node.ordered else node.properties)
            return [((_COLON, node_id, seen, key, 0), parent)] if key not in seen and (known or node.additional is not None) else []
        longer = key + bytes((byte,))
        if node.additional is None:  # only the schema's names, each once: the bytes so far begin one not yet used
            fits = any(name.startswith(longer) for name in node.next_names(seen))
            return [((_KEY, node_id, seen, longer, 0), parent)] if fits else []
        escape = _string_byte(escape, byte)
        room = len(longer) <= (MAX_KEY if escape == 0 else MAX_KEY - 5)  # an escape or character begun can always end
        return [((_KEY, node_id, seen, longer, escape), parent)] if escape >= 0 and room else []
    if kind == _COLON:
        _, node_id, seen, key, spaces = frame
        if byte in _WHITESPACE:
            return [((_COLON, node_id, seen, key, spaces + 1), parent)] if spaces < MAX_WHITESPACE else []
        if byte != 0x3A:  # :
            return []
        node = nodes[node_id]
        member = node.properties.get(key, node.additional)
        return [((_VALUE, member, 0), ((_OBJECT_NEXT, node_id, seen | {key}, 0), parent))]
    if kind in (_ARRAY_OPEN, _ARRAY_NEXT):
        node_id, count, spaces = (frame[1], 0, frame[2]) if kind == _ARRAY_OPEN else frame[1:]
        if byte in _WHITESPACE:
            again = (kind, node_id, spaces + 1) if kind == _ARRAY_OPEN else (kind, node_id, count, spaces + 1)
            return [(again, parent)] if spaces < MAX_WHITESPACE else []
        node = nodes[node_id]
        if byte == 0x5D:  # ]
            return [parent] if count >= node.min_items else []
        room = node.max_items is None or count < node.max_items
        if kind == _ARRAY_NEXT:
            return [((_VALUE, node.items, 0), ((_ARRAY_NEXT, node_id, count + 1, 0), parent))] if byte == 0x2C and room else []
        return _start(nodes, node.items, byte, ((_ARRAY_NEXT, node_id, 1, 0), parent)) if room else []
    if kind == _STRING:
        _, node_id, length, escape = frame
        if byte == 0x22 and escape == 0:
            return [parent] if length is None or length >= nodes[node_id].min_length else []
        after = _string_byte(escape, byte)
        if after < 0:
            return []
        if length is not None and escape == 0:  # a character begins
            length += 1
            limit = nodes[node_id].max_length
            if limit is not None and length > limit:
                return []
        return [((_STRING, node_id, length, after), parent)]
    if kind == _NUMBER:
        _, node_id, state, length = frame
        integer = nodes[node_id].integer
        digit = byte in _DIGITS
        if state == "m":
            state = "z" if byte == 0x30 else "i" if digit else None
        elif state in "zif" and byte == 0x2E:  # .
            state = "d" if state != "f" and not integer else None
        elif state in "zif" and byte in (0x65, 0x45):  # e E
            state = "e" if not integer else None
        elif state == "e" and byte in (0x2B, 0x2D):  # + -
            state = "s"
        elif digit and state != "z":
            state = {"i": "i", "d": "f", "f": "f", "e": "x", "s": "x", "x": "x"}[state]
        else:
            state = None
        if state is None or length + (1 if state in _NUMBER_END else 2) > MAX_NUMBER:  # room to end the number
            return []
        number = ((_NUMBER, node_id, state, length + 1), parent)
        return [number, parent] if state in _NUMBER_END else [number]
    return _literal(frame[1], frame[2], byte, parent)  # _LITERAL
