"""Review of tool calling (``engine/server/tools``, ``chat.py``, ``structured.py``): reproductions of defects.

Every test here reproduced one finding (it failed before the fix that made it pass; ``functions`` /
``function_call`` are refused by the strict request models). Unit tests need no server; the live ones share one colocated node on the tiny llama,
started with ``--enable-auto-tool-choice --tool-call-parser hermes`` (as in ``test_tool_calls.py``).
"""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import NodeProcess
from pdserve.engine.server.errors import describe_validation_errors
from pdserve.engine.server.protocol import ChatCompletionRequest, message_dicts
from pdserve.engine.server.structured import structured_source
from pdserve.engine.server.tools.config import ToolConfig
from pdserve.engine.server.tools.parsers import HermesParser, call_id_factory, parse_whole
from pdserve.engine.server.tools.plan import ToolPlan
from pdserve.engine.server.tools.render import message_fields
from pdserve.engine.structured.grammar import build_grammar

FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}
ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": ADD}}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NAMED_ADD = {"type": "function", "function": {"name": "add"}}


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


@pytest.fixture(scope="module")
def node(tiny_llama):
    node = NodeProcess(tiny_llama, *FLAGS)
    try:
        yield node.url
    finally:
        node.stop()


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"messages": USER, "temperature": 0, **body}, timeout=60)


def _streamed(url: str, body: dict) -> tuple[str | None, list[list[str]], str | None]:
    """(content, [[name, arguments]], finish_reason) reassembled from an SSE answer."""
    content, calls, reason = None, {}, None
    with httpx.stream("POST", url + "/v1/chat/completions",
                      json={"messages": USER, "temperature": 0, **body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                if choice["delta"].get("content") is not None:
                    content = (content or "") + choice["delta"]["content"]
                for part in choice["delta"].get("tool_calls") or ():
                    calls.setdefault(part["index"], [part["function"].get("name"), ""])
                    calls[part["index"]][1] += part["function"].get("arguments") or ""
                reason = choice["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


# ---------------------------------------------------------------------------------------------------------------
# Finding 1 (high): tool_choice "required" nests every tool's ``parameters`` under
# ``items.anyOf[i].properties.parameters`` of a new root (ToolPlan.forced_schema), so a root-relative JSON pointer
# in a tool's schema -- ``#/$defs/...`` (what pydantic and openai.pydantic_function_tool emit for nested models),
# ``#/definitions/...``, ``#/properties/...`` or a recursive ``#`` -- now points into the wrong document. The same tool
# works with a named tool_choice.

DEFS_TOOL = {"type": "function", "function": {"name": "locate", "parameters": {
    "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
    "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                      "required": ["city"]}}}}}


def test_required_with_defs_schema_is_served(node):
    named = _post(node, {"tools": [DEFS_TOOL], "tool_choice": {"type": "function", "function": {"name": "locate"}},
                         "max_tokens": 40})
    assert named.status_code == 200, named.text                       # the schema is fine...
    required = _post(node, {"tools": [DEFS_TOOL, ADD_TOOL], "tool_choice": "required", "max_tokens": 40})
    assert required.status_code == 200, required.text                 # ...but "required" refuses it


def test_required_with_recursive_schema_constrains_the_tools_shape():
    from xgrammar.testing import _is_grammar_accept_string

    node_schema = {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                   "required": ["next"]}
    body = _request(tools=[{"type": "function", "function": {"name": "f", "parameters": node_schema}}],
                    tool_choice="required")
    grammar = build_grammar(structured_source(body)[0])
    valid = '[{"name": "f", "parameters": {"next": {"next": null}}}]'           # follows f's schema
    wrong = '[{"name": "f", "parameters": {"next": [{"name": "f", "parameters": {"next": null}}]}}]'
    assert _is_grammar_accept_string(grammar, valid)                  # today: refused
    assert not _is_grammar_accept_string(grammar, wrong)              # today: accepted


# ---------------------------------------------------------------------------------------------------------------
# Finding 2 (medium): the "auto" parsers accept any "name", not only the request's tools. (a) llama3_json reads a
# JSON answer that happens to have a "name" key -- a response_format answer, which the docs say may go with "auto"
# -- as a call to a function that does not exist, and drops the answer (content null, the other keys lost).
# (b) a call the server itself emitted (hermes, name "get weather") cannot be sent back: the next request is a 400
# because ChatMessage.tool_calls[].function.name must match OpenAI's name pattern.


def test_llama3_json_keeps_a_json_answer_that_is_not_a_call_to_a_tool():
    body = _request(tools=[WEATHER_TOOL], response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                                       "age": {"type": "integer"}}}}})
    parser = ToolPlan.of(body).parser(ToolConfig(True, "llama3_json"))
    answer = parse_whole(parser, '{"name": "Bob", "age": 3}')
    assert [c.name for c in answer.calls] == []                        # today: [["Bob", "{}"]]
    assert answer.content == '{"name": "Bob", "age": 3}'               # today: None


def test_an_emitted_call_can_be_sent_back():
    body = _request(tools=[WEATHER_TOOL])
    parser = ToolPlan.of(body).parser(ToolConfig(True, "hermes"))
    message = {"role": "assistant", **message_fields(parser, '<tool_call>{"name": "get weather", "arguments": '
                                                             '{"city": "Paris"}}</tool_call>')}
    turn = USER + [message] + [{"role": "tool", "tool_call_id": c["id"], "content": "sunny"}
                               for c in message.get("tool_calls") or ()]
    ChatCompletionRequest.model_validate({"messages": turn, "tools": [WEATHER_TOOL]})   # today: ValidationError


# ---------------------------------------------------------------------------------------------------------------
# Finding 3 (medium): a stop string that cuts a forced call still reports finish_reason "tool_calls", with arguments
# that are not JSON ('{"a": 38' here, or "" under "required"); the docs promise "tool_calls" only when the answer
# "ended by itself". Clients json.loads the arguments of a "tool_calls" answer.


@pytest.mark.parametrize("choice", [NAMED_ADD, "required"], ids=["named", "required"])
def test_a_call_cut_by_a_stop_string_is_not_a_finished_call(node, choice):
    r = _post(node, {"tools": [ADD_TOOL], "tool_choice": choice, "max_tokens": 100, "stop": [","]})
    assert r.status_code == 200, r.text
    choice_ = r.json()["choices"][0]
    if choice_["finish_reason"] == "tool_calls":
        for call in choice_["message"]["tool_calls"]:
            json.loads(call["function"]["arguments"])                 # today: '{"a": 38' / ''


# ---------------------------------------------------------------------------------------------------------------
# Finding 4 (low): streamed and whole answers disagree on content. (a) hermes: whitespace around the calls (the "\n"
# Qwen writes between two <tool_call> blocks) is streamed as content but the whole answer has content null.
# (b) echo with a forced call: the stream sends the echoed text as content, the whole answer drops it (content null).


def test_hermes_whitespace_between_calls_streams_as_the_whole_answer():
    text = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    parser, content = HermesParser(), ""
    for piece in text:                                                # one character per delta
        content += parser.feed(piece).content
    content += parser.finish().content
    whole = parse_whole(HermesParser(), text)
    assert [c.name for c in whole.calls] == ["a", "b"]
    assert content == (whole.content or "")                           # today: "\n" vs None


def test_echo_with_a_forced_call_streams_as_the_whole_answer(node):
    body = {"messages": USER + [{"role": "assistant", "content": "Sure: "}], "add_generation_prompt": False,
            "echo": True, "tools": [ADD_TOOL], "tool_choice": NAMED_ADD, "max_tokens": 40}
    whole = _post(node, body).json()["choices"][0]
    content, calls, _ = _streamed(node, body)
    assert calls == [[c["function"]["name"], c["function"]["arguments"]] for c in whole["message"]["tool_calls"]]
    assert content == whole["message"]["content"]                      # today: "Sure: " vs None


# ---------------------------------------------------------------------------------------------------------------
# Finding 5 (low): a forced call's stream opens with {"role": "assistant", "content": ""}; the openai package's
# stream helper (client.chat.completions.stream / ChatCompletionStreamState) then gives content "" where the same
# request unstreamed gives null (OpenAI's own streams open a tool-call answer with content null).


def test_openai_stream_helper_sees_null_content_for_a_forced_call(node):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=node + "/v1", api_key="unused", max_retries=0, timeout=60)
    kwargs = dict(model=client.models.list().data[0].id, messages=USER, tools=[ADD_TOOL], tool_choice=NAMED_ADD,
                  max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0].message
    assert [c.function.arguments for c in streamed.tool_calls] == [c.function.arguments for c in whole.tool_calls]
    assert whole.content is None
    assert streamed.content is None                                    # today: ""


# ---------------------------------------------------------------------------------------------------------------
# Finding 6 (low): 400s that name the wrong field. (a) a bad tool_choice value names "tool_choice.NamedToolChoice"
# (a pydantic class name; errors._is_union_branch does not know it) and does not list "none"/"auto"/"required".
# (b) tools too big for the chat template's budget are a 400 naming "messages".


def test_a_bad_tool_choice_names_tool_choice():
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as refused:
        _request(tools=[ADD_TOOL], tool_choice="any")
    message, param = describe_validation_errors(refused.value.errors())
    assert param == "tool_choice", (param, message)
    assert "required" in message, message


def test_tools_too_big_for_the_template_name_tools(node):
    big = {"type": "function", "function": {"name": "f", "description": "x" * 40000}}
    r = _post(node, {"tools": [big], "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools", r.text               # today: "messages"


# ---------------------------------------------------------------------------------------------------------------
# Finding 7 (low): the legacy OpenAI fields ``functions`` / ``function_call`` (still accepted by OpenAI and sent by
# older clients) are silently ignored: a request forcing function_call {"name": "add"} gets plain text back.


def test_legacy_function_call_is_served_or_refused(node):
    r = _post(node, {"functions": [{"name": "add", "parameters": ADD}], "function_call": {"name": "add"},
                     "max_tokens": 20})
    if r.status_code == 200:
        message = r.json()["choices"][0]["message"]
        assert message.get("tool_calls") or message.get("function_call"), message
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] in ("functions", "function_call"), r.text


# ---------------------------------------------------------------------------------------------------------------
# Finding 8 (low, interoperability): call ids are "call_" + 24 hex; Mistral's chat templates (the "mistral"
# architecture is supported) raise "Tool call IDs should be alphanumeric strings with length 9!" on an assistant
# turn carrying them, so a forced call's conversation cannot go on under the model's own template (vLLM writes
# 9-character ids for Mistral). A minimal template with that check:

MISTRAL_LIKE = (
    "{% for message in messages %}"
    "{% if message.tool_calls is defined and message.tool_calls %}"
    "{% for call in message.tool_calls %}"
    "{% if not call.id is defined or call.id|length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "[TOOL_CALLS]{{ call.function|tojson }}{% endfor %}"
    "{% else %}[{{ message.role }}]{{ message.content }}{% endif %}{% endfor %}")


def test_call_ids_fit_a_mistral_template(tiny_llama):
    from pdserve.engine.text.chat_template import render_chat
    from pdserve.engine.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)
    tokenizer.chat_template = MISTRAL_LIKE
    body = _request(tools=[ADD_TOOL], tool_choice=NAMED_ADD)
    ids = call_id_factory(MISTRAL_LIKE)                  # what a node makes of this template (common.make_node_state)
    message = {"role": "assistant", **message_fields(ToolPlan.of(body).parser(ToolConfig(), ids), '{"a": 1, "b": 2}')}
    turn = ChatCompletionRequest.model_validate({"messages": USER + [message], "tools": [ADD_TOOL]})
    render_chat(tokenizer, message_dicts(turn.messages), True, tools=ToolPlan.of(turn).template_tools)


# ---------------------------------------------------------------------------------------------------------------
# Finding 9 (medium): the parsers are quadratic in the length of the text they read, character by character:
# CallScanner._take appends one character at a time to an attribute string (``self.arguments += ch``, copied every
# time by CPython), HermesParser._close and RequiredParser.feed cut ``text = text[1:]`` per character. 300,000
# characters of arguments (a write_file tool's content, ~75k tokens) take ~5 s; 200,000 newlines after a hermes call
# (a small model looping on "\n" until max_tokens) ~2 s -- all on the event loop (``_response`` parses every
# choice there, n up to 16), so the node answers nothing else meanwhile, /health included. Named calls do not use
# the scanner; "required" and "auto" (hermes, llama3_json) do.

LONG_TEXTS = {
    "required arguments": (lambda n: '[{"name": "f", "parameters": ' + json.dumps({"content": "x" * n}) + '}]',
                           "required"),
    "hermes newlines after a call": (lambda n: '<tool_call>{"name": "f", "arguments": {}}' + "\n" * n, "auto"),
}


@pytest.mark.parametrize("case", list(LONG_TEXTS))
def test_parsing_is_linear_in_the_answers_length(case, monkeypatch):
    """Counted, not timed: the per-character step of the scanner runs for the JSON structure only (a string's
    inside is taken a run at a time), and whitespace runs are skipped by one search -- so 300,000 characters
    cost a few hundred Python steps, as 3,000 do."""
    from pdserve.engine.server.tools import scanner

    make, choice = LONG_TEXTS[case]
    body = _request(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice=choice)
    steps = {"n": 0}
    per_char = scanner.CallScanner._char

    def counted(self, ch):
        steps["n"] += 1
        return per_char(self, ch)

    monkeypatch.setattr(scanner.CallScanner, "_char", counted)
    counts = []
    for chars in (3_000, 300_000):
        steps["n"] = 0
        answer = parse_whole(ToolPlan.of(body).parser(ToolConfig(True, "hermes")), make(chars))
        assert [c.name for c in answer.calls] == ["f"]
        counts.append(steps["n"])
    assert counts[1] == counts[0] < 200, counts


# ---------------------------------------------------------------------------------------------------------------
# Finding 10 (medium): a 500 made by the model's output. The scanner JSON-decodes a call's name (and an arguments
# value written as a JSON string); a model writing the escape ``\ud800`` (a lone surrogate: half of an emoji's pair)
# yields a str that UTF-8 cannot encode, and the non-streamed answer is "500 internal error: UnicodeEncodeError"
# (through the proxy: 502 after the decode node's 500, the generation retried). The regex steers the tiny model.

SURROGATE_CALLS = {
    "name": r'<tool_call>\{"name": "\\ud800", "arguments": \{\}\}</tool_call>',
    "quoted arguments": r'<tool_call>\{"name": "get_weather", "arguments": "\\ud800"\}</tool_call>',
}


@pytest.mark.parametrize("where", list(SURROGATE_CALLS))
def test_a_surrogate_escape_in_a_call_is_not_a_500(node, where):
    r = _post(node, {"tools": [WEATHER_TOOL], "max_tokens": 80,
                     "structured_outputs": {"regex": SURROGATE_CALLS[where]}})
    assert r.status_code == 200, r.text
