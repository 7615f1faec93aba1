"""Tool-call output parsers (``engine/server/tools``): the text a model writes, cut anywhere, reads back as the
calls and content it holds -- and a streamed answer reassembles to exactly what the whole answer gives.

Hypothesis writes calls (names by OpenAI's rule, arguments any JSON object -- strings with braces, quotes and
escapes included), lays them out as each parser's format with content around them, and cuts the text at random
points. Edge cases: arguments before the name, arguments as a quoted string, no arguments, a block that is not a
call, a tag cut in half, ``parallel_tool_calls`` false.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from pdserve.engine.server.tools.parsers import (HermesParser, Llama3JsonParser, NamedParser, RequiredParser,
                                                 parse_whole)
from pdserve.engine.server.tools.scanner import CallScanner

NAMES = st.from_regex(r"[a-zA-Z0-9_-]{1,12}", fullmatch=True)
SCALARS = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                          max_size=3), max_leaves=8)
ARGS = st.dictionaries(st.text(max_size=6), JSON, max_size=4)
CALLS = st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3)
CONTENT = st.text(alphabet="ab <>/{}\n", max_size=12).filter(lambda t: "<tool_call>" not in t)


def cuts(text: str, data) -> list[str]:
    points = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def streamed(parser, pieces: list[str]) -> tuple[str, list[list]]:
    content, calls = "", []
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += delta.content
        for call in delta.calls:
            if call.id is not None:
                assert call.id.startswith("call_") and call.name, call
                calls.append([call.name, call.arguments])
            else:
                assert calls and calls[-1] is not None, "arguments before their call's id and name"
                calls[-1][1] += call.arguments
    return content, calls


def whole(parser, text: str) -> tuple[str | None, list[list]]:
    answer = parse_whole(parser, text)
    return answer.content, [[c.name, c.arguments] for c in answer.calls]


def as_calls(calls) -> list[list]:
    return [[name, json.dumps(args, ensure_ascii=False)] for name, args in calls]


@settings(max_examples=150, deadline=None)
@given(calls=CALLS, before=CONTENT, after=CONTENT, data=st.data())
def test_hermes_reads_calls_and_content_however_cut(calls, before, after, data):
    blocks = "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a}, ensure_ascii=False)}\n</tool_call>'
                     for n, a in calls)
    text = before + blocks + after
    content, got = streamed(HermesParser(), cuts(text, data))
    assert got == as_calls(calls)
    assert content == (before + after).rstrip(" \t\n\r")    # trailing whitespace of an answer with calls: dropped
    assert whole(HermesParser(), text)[1] == got


@settings(max_examples=150, deadline=None)
@given(calls=CALLS, tag=st.booleans(), data=st.data())
def test_llama3_json_reads_calls_however_cut(calls, tag, data):
    text = ("<|python_tag|>" if tag else " ") + "; ".join(
        json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
    content, got = streamed(Llama3JsonParser(), cuts(text, data))
    assert got == as_calls(calls) and content == ""
    assert whole(Llama3JsonParser(), text) == (None, got)


@settings(max_examples=150, deadline=None)
@given(calls=CALLS, data=st.data())
def test_required_reads_the_array_however_cut(calls, data):
    text = json.dumps([{"name": n, "parameters": a} for n, a in calls], ensure_ascii=False)
    content, got = streamed(RequiredParser(), cuts(text, data))
    assert got == as_calls(calls) and content == ""
    assert whole(RequiredParser(), text) == (None, got)


@settings(max_examples=50, deadline=None)
@given(args=ARGS, data=st.data())
def test_named_is_all_arguments(args, data):
    text = json.dumps(args)
    assert streamed(NamedParser("f"), cuts(text, data)) == ("", [["f", text]])
    assert whole(NamedParser("f"), text) == (None, [["f", text]])


def test_plain_content_stays_content():
    for parser in (HermesParser(), Llama3JsonParser()):
        assert whole(parser, "Paris is the capital.") == ("Paris is the capital.", [])
    assert streamed(HermesParser(), ["a <tool", "_ca", "ll is a tag"]) == ("a <tool_call is a tag", [])
    assert streamed(HermesParser(), ["ends with <tool_c"]) == ("ends with <tool_c", [])
    assert streamed(Llama3JsonParser(), ["<|pyth", "on is not"]) == ("<|python is not", [])


def test_not_a_call_is_content():
    text = 'x<tool_call>{"nam": 1}</tool_call>y'
    assert whole(HermesParser(), text) == ('x<tool_call>{"nam": 1}</tool_call>y', [])
    assert whole(HermesParser(), "<tool_call>oops</tool_call>") == ("<tool_call>oops</tool_call>", [])
    assert whole(Llama3JsonParser(), '{"parameters": {}}') == ('{"parameters": {}}', [])
    assert whole(Llama3JsonParser(), "[1, 2]") == ("[1, 2]", [])


@pytest.mark.parametrize("text, name, arguments", [
    ('{"arguments": {"a": "}"}, "name": "f"}', "f", '{"a": "}"}'),              # arguments first: held for the name
    ('{"name": "f", "arguments": "{\\"a\\": 1}"}', "f", '{"a": 1}'),           # quoted: decoded
    ('{"name": "f"}', "f", "{}"),                                              # none: {}
    ('{"name": "f", "parameters": 7, "extra": [1, {"x": "]"}]}', "f", "7"),   # a scalar, then more keys
    ('{"name": "f\\u00e9", "arguments": {}}', "fé", "{}"),                     # an escaped name
])
def test_scanner_edges(text, name, arguments):
    for size in (1, 2, 5, len(text)):
        scanner, given = CallScanner(), ""
        for i in range(0, len(text), size):
            assert scanner.feed(text[i:i + size]) == ""
            got_name, fragment = scanner.take()
            given += fragment
        assert scanner.done and not scanner.failed and scanner.name == name
        assert given + scanner.take()[1] == arguments


def test_scanner_returns_what_follows_the_object():
    scanner = CallScanner()
    assert scanner.feed('{"name": "f", "arguments": {}}</tool_call>') == "</tool_call>"
    assert scanner.done and scanner.final_arguments == "{}"


def test_parallel_false_keeps_the_first_call():
    text = '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert whole(HermesParser(parallel=False), text) == (None, [["a", '{"x": 1}']])
    assert whole(RequiredParser(parallel=False), '[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {}}]') \
        == (None, [["a", "{}"]])


def test_a_cut_off_call_keeps_what_came():
    assert whole(HermesParser(), '<tool_call>{"name": "f", "arguments": {"a": "Par') == (None, [["f", '{"a": "Par']])
    assert whole(HermesParser(), '<tool_call>{"na') == ('<tool_call>{"na', [])
