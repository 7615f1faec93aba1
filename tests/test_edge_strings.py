"""Strings the tokenizer cannot take are a 400 naming the field, on a node and through the proxy; SSE is ASCII.

One real tiny-llama node (``--role both``) and one proxy process in front of it (prefill and decode both that
node), started once for the module. The node serves under a name with U+2028, U+0085 and \\x1c in it, so every
streamed chunk carries those characters (each chunk names its model): a deterministic way to get them into
``data:`` lines.

Before (issue 35): a lone UTF-16 surrogate in a prompt was a 500 ``TextEncodeInput must be ...`` on node and
proxy (streaming too, in prompt lists, on /tokenize); one in ``user``, a message's ``name``, ``stream_options``
or any field the proxy forwards was a 500 at the proxy (its UTF-8 body to the node) while the node answered
200; one in chat content was a 400 quoting a TypeError; a NaN in an unknown field was 200 at the node and 500
at the proxy; and SSE ``data:`` lines carried raw U+2028 / U+0085 / \\x1c, which split some clients' lines.
"""

from __future__ import annotations

import json

import httpx
import pytest

from test_proxy_support import ProxyProcess, proxy_factory  # noqa: F401

CMPL, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
NAME = "tiny\u2028llama\x85x\x1cy"             # the served model name: line separators inside
BAD = "ok\ud800ok"                             # a lone high surrogate
USER = [{"role": "user", "content": "Once upon a time"}]
BASE = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
SPLITTERS = ("\u2028".encode(), "\x85".encode(), b"\x1c")     # as UTF-8 bytes on the wire


def _chat(**fields) -> dict:
    return {"messages": USER, "max_tokens": 3, "temperature": 0, **fields}


def _message(**fields) -> dict:
    return _chat(messages=[{"role": "user", "content": "hi", **fields}])


# (case id, path, body with a bad string, the error's ``param``)
GENERATION = [
    ("prompt", CMPL, {**BASE, "prompt": BAD}, "prompt"),
    ("prompt list", CMPL, {**BASE, "prompt": ["fine", BAD]}, "prompt.1"),
    ("stop string", CMPL, {**BASE, "stop": BAD}, "stop"),
    ("stop list", CMPL, {**BASE, "stop": ["x", BAD]}, "stop.1"),
    ("model", CMPL, {**BASE, "model": BAD}, "model"),
    ("user", CMPL, {**BASE, "user": BAD}, "user"),
    ("cache_salt", CMPL, {**BASE, "cache_salt": BAD}, "cache_salt"),
    ("metadata value", CMPL, {**BASE, "metadata": {"k": BAD}}, "metadata.k"),
    ("a refused field's value", CMPL, {**BASE, "allowed_token_ids": [{"b": BAD}]}, "allowed_token_ids"),
    ("logit_bias key", CMPL, {**BASE, "logit_bias": {BAD: 1}}, None),   # param: pydantic's lossy loc of the key
    ("chat content", CHAT, _chat(messages=[{"role": "user", "content": BAD}]), "messages.0.content"),
    ("chat role", CHAT, _chat(messages=[{"role": BAD, "content": "hi"}]), "messages.0.role"),
    ("message name", CHAT, _message(name=BAD), "messages.0.name"),
    ("message tool_calls", CHAT, _message(tool_calls=[{"id": "1", "type": "function",
                                                        "function": {"name": "f", "arguments": BAD}}]),
     "messages.0.tool_calls.0.function.arguments"),
    ("message extra key, deep", CHAT, _message(extra={"a": [1, {"b": BAD}]}), "messages.0.extra"),
    ("message extra key's key", CHAT, _message(extra={BAD: 1}), "messages.0.extra"),
    ("content part text", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "text", "text": BAD}]}]),
     "messages.0.content.0.text"),
    ("content part type", CHAT, _chat(messages=[{"role": "user", "content": [{"type": BAD}]}]),
     "messages.0.content.0.type"),
    ("tools", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f", "description": BAD}}]),
     "tools.0.function.description"),
    ("functions (refused)", CHAT, _chat(functions=[{"name": BAD}]), "functions"),
    ("chat user", CHAT, _chat(user=BAD), "user"),
]
NODE_ONLY = [            # the proxy serves neither route; kv_transfer_params it refuses from clients by name
    ("tokenize prompt", TOK, {"prompt": BAD}, "prompt"),
    ("tokenize messages", TOK, {"messages": [{"role": "user", "content": BAD}]}, "messages.0.content"),
    ("detokenize model", DETOK, {"tokens": [1, 2], "model": BAD}, "model"),
    ("kv_transfer_params", CMPL, {**BASE, "kv_transfer_params": {"note": BAD}}, "kv_transfer_params"),
]


@pytest.fixture(scope="module")
def node(tiny_llama, node_factory):
    return node_factory(tiny_llama, "--served-model-name", NAME, "--max-model-len", "128",
                        "--num-gpu-blocks-override", "64")


@pytest.fixture(scope="module")
def proxy(tiny_llama, node, proxy_factory) -> ProxyProcess:
    return proxy_factory(tiny_llama, [node.url], [node.url])


@pytest.fixture(params=["node", "proxy"])
def base(request, node) -> str:
    return node.url if request.param == "node" else request.getfixturevalue("proxy").url


def _post(base: str, path: str, body, **kwargs) -> httpx.Response:
    """``body`` as ASCII JSON (a lone surrogate as its ``\\udXXX`` escape, which httpx's ``json=`` cannot send)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(base + path, content=raw, headers={"content-type": "application/json"}, timeout=60, **kwargs)


def _check_400(response: httpx.Response, param: str | None, words: tuple[str, ...]) -> None:
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]


def _check_still_serving(node) -> None:
    assert httpx.get(node.url + "/health", timeout=30).status_code == 200
    assert node.proc.poll() is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case, path, body, param", GENERATION, ids=[c[0] for c in GENERATION])
def test_a_lone_surrogate_in_any_field_is_a_400_naming_it(node, base, case, path, body, param, stream):
    _check_400(_post(base, path, {**body, "stream": stream}), param, ("lone UTF-16 surrogate", "\\ud800"))
    _check_still_serving(node)


@pytest.mark.parametrize("case, path, body, param", NODE_ONLY, ids=[c[0] for c in NODE_ONLY])
def test_a_lone_surrogate_on_the_nodes_other_routes_is_a_400(node, case, path, body, param):
    _check_400(_post(node.url, path, body), param, ("lone UTF-16 surrogate",))
    _check_still_serving(node)


RAW = [
    ("raw surrogate bytes", CMPL, b'{"prompt": "ok\xed\xa0\x80ok", "max_tokens": 3}', "prompt", ("surrogate",)),
    ("a low surrogate alone", CMPL, b'{"prompt": "\\udc00", "max_tokens": 3}', "prompt", ("\\udc00",)),
    ("a surrogate field name", CMPL, b'{"prompt": "hi", "x\\ud800": 1}', None, ("field name", "\\ud800")),
    ("NaN in an unknown field (refused by name)", CMPL, b'{"prompt": "hi", "max_tokens": 3, "pad": [NaN]}', "pad",
     ("unknown field 'pad'",)),
    ("NaN deep in a message's extra", CHAT, b'{"messages": [{"role": "user", "content": "hi", "w": [{"v": NaN}]}]}',
     "messages.0.w", ("finite",)),
    ("Infinity in a message's extra", CHAT, b'{"messages": [{"role": "user", "content": "hi", "w": Infinity}]}',
     "messages.0.w", ("finite",)),
]


@pytest.mark.parametrize("case, path, raw, param, words", RAW, ids=[c[0] for c in RAW])
def test_bodies_no_strict_encoder_could_forward_are_a_400(node, base, case, path, raw, param, words):
    _check_400(_post(base, path, raw), param, words)
    _check_still_serving(node)


def _data_lines(response: httpx.Response) -> list[bytes]:
    """The ``data:`` lines of an SSE body, split on \\n only (the framing SSE defines), as raw bytes."""
    return [line for line in response.content.split(b"\n") if line.startswith(b"data:")]


@pytest.mark.parametrize("path, body", [
    (CMPL, {**BASE, "prompt": "caf\u00e9 \ud83d\ude00 \u2028", "user": "\u00e9\u2028", "stream": True,
            "stream_options": {"include_usage": True}}),
    (CHAT, _chat(messages=[{"role": "user", "name": "b\u00f6b",
                            "content": [{"type": "text", "text": "\ud83d\ude00\x85"}]}],
                 stream=True, logprobs=True, top_logprobs=2)),
], ids=["completions", "chat"])
def test_sse_data_lines_are_ascii(node, base, path, body):
    """Run last: the node serves on after every refusal above. The prompts hold valid Unicode only (a pair of
    surrogate escapes is one character, U+1F600): the check refuses lone surrogates, nothing else."""
    response = _post(base, path, body)
    assert response.status_code == 200, response.text[:500]
    lines = _data_lines(response)
    assert lines[-1] == b"data: [DONE]" and len(lines) >= 3, lines
    for line in lines:
        assert line.isascii(), line
        assert not any(s in line for s in SPLITTERS), line
    payloads = [json.loads(line[len(b"data:"):]) for line in lines[:-1]]
    assert {p["model"] for p in payloads} == {NAME}      # the characters are there, escaped
    for line in lines:                                    # and a line reader that splits on them sees one line
        assert len(line.decode().splitlines()) == 1
