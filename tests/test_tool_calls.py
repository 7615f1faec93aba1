"""Tool calling over HTTP with the official ``openai`` client (issue 37): a local P/D cluster (what ``pdserve serve``
runs) and a colocated node, both started with ``--enable-auto-tool-choice --tool-call-parser hermes``, on a tiny
random model whose ChatML template renders tools Hermes style.

- ``tool_choice="required"`` and a named function: ``tool_calls`` whose arguments validate against the tool's
  schema, ``finish_reason`` "tool_calls", the same greedy calls colocated and disaggregated (the prefill node
  samples the first token under the constraint); ``parallel_tool_calls`` false: one call.
- Streaming: the first delta of a call has its id, type and name; the argument fragments reassemble to the
  non-streamed call.
- "auto": the hermes parser reads ``<tool_call>`` blocks (the model is steered into writing one by a regex, as a
  random model never would), streamed or whole, through the proxy too.
- A conversation with an assistant's call and the tool's answer goes on; the template sees the tools.
- 400s naming the field: a named function not among the tools, tool_choice without tools, a bad parameters
  schema, a forced call with another constraint, ``tool_choice`` "auto" on a server without the flags (the
  proxy's own check) -- and the servers keep serving.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema_rs
import pytest

from conftest import openai_client, pd_and_colocated

openai = pytest.importorskip("openai")

FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "hourly": {"type": "boolean"}},
           "required": ["city", "days", "hourly"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
ADD_CALL = '<tool_call>\n\\{"name": "add", "arguments": \\{"a": [1-9], "b": [1-9]\\}\\}\n</tool_call>'


@pytest.fixture(scope="module")
def servers(tiny_llama):
    """{"proxy": url, "node": url}: a P/D cluster and a colocated node, both reading tool calls with hermes."""
    with pd_and_colocated(tiny_llama, FLAGS) as urls:
        yield urls


def _client(url: str):
    return openai_client(url, 120)


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


def _validate(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema_rs.validate(SCHEMAS[name], json.loads(arguments))


def _stream(client, **kwargs) -> tuple[list[tuple[str, str]], str | None, str]:
    """(calls reassembled from the deltas, the finish reason, content) of a streamed answer."""
    calls, reason, content = {}, None, ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for part in choice.delta.tool_calls or ():
            if part.index not in calls:
                assert part.id and part.type == "function" and part.function.name, part   # id and name first
                calls[part.index] = [part.function.name, part.function.arguments or ""]
            else:
                assert part.id is None and part.function.name is None, part
                calls[part.index][1] += part.function.arguments or ""
        reason = choice.finish_reason or reason
    return [tuple(c) for _, c in sorted(calls.items())], reason, content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_forced_calls_validate_stream_alike_and_match_across_pd(servers, choice):
    answers = {}
    for where, url in servers.items():
        client = _client(url)
        kwargs = dict(model="llama", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=400,
                      temperature=0)
        r = client.chat.completions.create(**kwargs)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content is None, (where, r)
        calls = _calls(message)
        _validate(calls)
        assert all(c.id.startswith("call_") for c in message.tool_calls)
        if isinstance(choice, dict):
            assert [name for name, _ in calls] == ["add"]
        streamed, reason, content = _stream(client, **kwargs)
        assert (streamed, reason, content) == (calls, "tool_calls", ""), where
        answers[where] = calls
    assert answers["proxy"] == answers["node"]


def test_parallel_tool_calls_false_makes_one_call(servers):
    for where, url in servers.items():
        r = _client(url).chat.completions.create(model="llama", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                 parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=5,
                                                 n=3)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, (where, c)
            _validate(_calls(c.message))


def test_auto_reads_hermes_blocks(servers):
    """A regex makes the model write a <tool_call> block after some text; the parser finds it."""
    regex = "Let me add\\. " + ADD_CALL
    answers = {}
    for where, url in servers.items():
        client = _client(url)
        kwargs = dict(model="llama", messages=MESSAGES, tools=TOOLS, max_tokens=80, temperature=0,
                      extra_body={"structured_outputs": {"regex": regex}})
        r = client.chat.completions.create(**kwargs)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add.", (where, r)
        calls = _calls(choice.message)
        _validate(calls)
        assert _stream(client, **kwargs) == (calls, "tool_calls", "Let me add.")
        answers[where] = calls
        none = client.chat.completions.create(**kwargs, tool_choice="none")
        assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content
        assert none.choices[0].finish_reason == "stop"
    assert answers["proxy"] == answers["node"]


def test_a_conversation_with_a_tool_result_goes_on(servers):
    turn = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    for where, url in servers.items():
        client = _client(url)
        r = client.chat.completions.create(model="llama", messages=turn, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
        assert r.choices[0].message.content and r.choices[0].message.tool_calls is None, (where, r)
        again = client.chat.completions.create(model="llama", messages=turn, tools=TOOLS,
                                               tool_choice={"type": "function", "function": {"name": "add"}},
                                               max_tokens=60, temperature=0)
        _validate(_calls(again.choices[0].message))
    node = servers["node"]
    with_tools = httpx.post(node + "/tokenize", json={"messages": turn, "tools": TOOLS}).json()
    without = httpx.post(node + "/tokenize", json={"messages": turn}).json()
    text = httpx.post(node + "/detokenize", json={"tokens": with_tools["tokens"]}).json()["prompt"]
    assert '"name": "get_weather"' in text and "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert '"city": "Paris"' in text and with_tools["count"] > without["count"] + 20


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools.2.function.name", "repeats the function name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tool_choice", "invalid JSON schema"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "one structured-output constraint"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type", "function"),
]


@pytest.mark.parametrize("extra, param, words", BAD, ids=[b[2].split()[-1] for b in BAD])
def test_bad_tool_requests_are_400_naming_the_field(servers, extra, param, words):
    for where, url in servers.items():
        r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, **extra}, timeout=60)
        assert r.status_code == 400, (where, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (where, error)
        ok = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, (where, ok.text)


def test_auto_needs_the_flags(tiny_llama):
    """A proxy (or node) started without --enable-auto-tool-choice refuses "auto" -- the default with tools."""
    from pdserve.engine.server.errors import APIError
    from pdserve.engine.server.tools.config import ToolConfig
    from pdserve.engine.text.tokenizer import load_tokenizer
    from pdserve.proxy.inputs import CHAT, Gate, Routing, parse_request

    tokenizer, routing = load_tokenizer(tiny_llama), Routing(256, "t")
    body = json.dumps({"messages": MESSAGES, "tools": TOOLS}).encode()
    with pytest.raises(APIError) as refused:
        asyncio.run(parse_request(CHAT, body, tokenizer, routing))
    assert refused.value.param == "tool_choice" and "--enable-auto-tool-choice" in refused.value.message
    gate = Gate.build(tokenizer, routing, tools=ToolConfig(True, "hermes"))
    assert asyncio.run(parse_request(CHAT, body, tokenizer, routing, gate)).prompt_ids
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolConfig(enable_auto_tool_choice=True)
