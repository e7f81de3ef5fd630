"""The structured-outputs grammar against the ``jsonschema`` validator: every document the grammar can produce
(random walks through it) parses with ``json.loads`` and validates against its schema; valid documents are taken
byte by byte and end complete; documents that break the schema are refused at the first byte that breaks it;
keywords outside the subset are refused by name."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from shared.json_grammar import MAX_DEPTH, MAX_WHITESPACE, JsonGrammar, Matcher, SchemaError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bé", 'c"d']}, "minItems": 1, "maxItems": 3},
        "kind": {"enum": [1, 10, "x", None, True]},
        "nick": {"type": ["string", "null"]},
        "address": {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}]},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["value"],
        }
    },
    "$ref": "#/$defs/node",
}
OPEN_OBJECT = {"type": "object"}
SCHEMAS = {
    "person": PERSON,
    "tree": TREE,
    "open-object": OPEN_OBJECT,
    "any": True,
    "array-of-numbers": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
}
ALPHABET = list(range(0x20, 0x7F)) + [0x0A, 0xC3, 0xA9]  # printable ASCII, a newline, and 'é' as UTF-8


def feed(matcher: Matcher, text: str | bytes) -> Matcher | None:
    return matcher.feed(text.encode() if isinstance(text, str) else text)


def random_document(grammar: JsonGrammar, rng: random.Random, limit: int = 400) -> bytes | None:
    """A random walk: each byte drawn among those the grammar takes, ending once complete (with growing odds)."""
    matcher, out = grammar.start(), bytearray()
    while len(out) < limit:
        if matcher.complete and (matcher.finished or rng.random() < 0.3):
            return bytes(out)
        choices = [b for b in ALPHABET if matcher.feed((b,)) is not None]
        structural = [b for b in choices if b in b'{}[],:"0123456789-tfn']  # keep walks from wandering in strings forever
        byte = rng.choice(structural if structural and rng.random() < 0.7 else choices)
        matcher = matcher.feed((byte,))
        out.append(byte)
    return None


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_document_a_random_walk_produces_is_json_valid_under_its_schema(name: str) -> None:
    schema = SCHEMAS[name]
    grammar, rng, produced = JsonGrammar(schema), random.Random(7), 0
    for _ in range(150):
        document = random_document(grammar, rng)
        if document is None:
            continue
        jsonschema.validate(json.loads(document), schema)
        produced += 1
    assert produced >= 50


@pytest.mark.parametrize(
    "document",
    [
        '{"name": "Ann", "age": 31, "tags": ["a", "bé"]}',
        '{\n  "tags": ["c\\"d"],\n  "age": -0,\n  "name": "\\u00e9\\n",\n  "height": 1.5e-3,\n  "kind": 10\n}',
        '{"name":"x","age":0,"tags":["a"],"kind":null,"nick":null,"address":{"city":"Oslo"}}',
        '{"name":"x","age":7,"tags":["a","a","a"],"kind":true,"nick":"n","address":"here"}',
    ],
)
def test_valid_documents_are_taken_byte_by_byte_and_end_complete(document: str) -> None:
    jsonschema.validate(json.loads(document), PERSON)
    matcher = JsonGrammar(PERSON).start()
    for i, byte in enumerate(document.encode()):
        assert not matcher.finished, i
        matcher = matcher.feed((byte,))
        assert matcher is not None, f"refused at byte {i}: {document[: i + 1]!r}"
    assert matcher.complete and matcher.finished


@pytest.mark.parametrize(
    "prefix, refused, why",
    [
        ('{"name": "Ann", "age": 3', "}", "a required member (tags) is missing"),
        ('{"name": "Ann", "', "nam", "name is taken once"),
        ('{"', "nickname", "no member the schema does not name"),
        ('{"age": ', '"', "age is an integer"),
        ('{"age": 0', "1", "no leading zeros"),
        ('{"age": 1', ".", "an integer has no fraction"),
        ('{"height": 1.', "e", "a fraction needs a digit"),
        ('{"tags": [', "]", "minItems 1"),
        ('{"tags": ["a", "a", "a"', ",", "maxItems 3"),
        ('{"tags": ["', "x", 'enum: only a, bé or c"d'),
        ('{"name": "', '"', "minLength 1"),
        ('{"name": "abcdefghijkl', "m", "maxLength 12"),
        ('{"name": "a', "\n", "no raw control character in a string"),
        ('{"name": "a\\', "x", "no such escape"),
        ('{"kind": 1', "1", "enum 1 or 10, not 11"),
        ('{"name": "a", "age": 1, "tags": ["a"]}', " ", "nothing after the value"),
        ("", " " * (MAX_WHITESPACE + 1), "whitespace is bounded"),
    ],
)
def test_bytes_that_break_the_schema_are_refused(prefix: str, refused: str, why: str) -> None:
    matcher = feed(JsonGrammar(PERSON).start(), prefix)
    assert matcher is not None, f"the prefix itself was refused: {prefix!r}"
    assert feed(matcher, refused) is None, why


def test_numbers_and_literals_end_where_the_value_may_end() -> None:
    grammar = JsonGrammar({"type": "number"})
    assert feed(grammar.start(), "-12.5e+3").complete
    assert not feed(grammar.start(), "-12.").complete and not feed(grammar.start(), "-").complete
    matcher = feed(JsonGrammar({"enum": [1, 10]}).start(), "1")
    assert matcher.complete and not matcher.finished and feed(matcher, "0").finished


def test_recursive_refs_nest() -> None:
    matcher = feed(JsonGrammar(TREE).start(), '{"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]}')
    assert matcher is not None and matcher.finished
    assert feed(JsonGrammar(TREE).start(), '{"value": 1, "children": [{"children": []}') is None  # a child without its value


def test_json_object_mode_takes_any_object_and_only_an_object() -> None:
    grammar = JsonGrammar.json_object()
    assert feed(grammar.start(), '{"a": [1, {"b": null}], "c": "d"}').finished
    assert feed(grammar.start(), "[") is None and feed(grammar.start(), '"') is None


def test_a_plain_string_state_is_recognised() -> None:
    matcher = feed(JsonGrammar(PERSON).start(), '{"nick": "ab')
    assert matcher.in_plain_string
    assert not feed(JsonGrammar(PERSON).start(), '{"name": "ab').in_plain_string  # its length is counted


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "string", "pattern": "^a"}, "pattern"),
        ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}, "minimum"),
        ({"type": "array", "prefixItems": [{"type": "string"}]}, "prefixItems"),
        ({"type": "strin"}, "'strin'"),
        ({"$ref": "#/$defs/missing"}, "#/$defs/missing"),
        ({"$ref": "https://example.com/schema"}, "must point into this schema"),
        ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "allOf"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "'b'"),
        ({"enum": []}, "enum"),
        (["not", "a", "schema"], "must be an object"),
    ],
)
def test_schemas_outside_the_subset_are_refused_by_name(schema: object, keyword: str) -> None:
    with pytest.raises(SchemaError, match=keyword.replace("$", r"\$")):
        JsonGrammar(schema)


def test_nesting_is_bounded() -> None:
    deepest = feed(JsonGrammar(True).start(), "[" * MAX_DEPTH)
    assert deepest is not None and feed(deepest, "[") is None and feed(deepest, "{") is None
    assert feed(deepest, "1" + "]" * MAX_DEPTH).finished


def test_text_around_the_value_and_property_ordering() -> None:
    call = {"type": "object", "properties": {"name": {"const": "f"}, "arguments": {"type": "object"}}, "propertyOrdering": ["name", "arguments"]}
    grammar = JsonGrammar(call, b"<tool_call>\n", b"\n</tool_call>")
    assert feed(grammar.start(), '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>').finished
    assert feed(grammar.start(), '{"name"') is None  # the prefix comes first
    assert feed(grammar.start(), '<tool_call>\n{"arguments"') is None  # name first, then arguments
    assert feed(grammar.start(), '<tool_call>\n{"name": "f"}') is None  # both members, always
    assert not feed(grammar.start(), '<tool_call>\n{"name": "f", "arguments": {}}').complete  # the suffix is owed
    with pytest.raises(SchemaError, match="propertyOrdering"):
        JsonGrammar({"type": "object", "properties": {"a": {}, "b": {}}, "propertyOrdering": ["b", "a"]})
