"""One request of every hostile class (``hostile_cases``) against a real node and the proxy.

The node refuses each with the status and message the table names, and keeps serving: ``/health`` is
200 afterwards and a greedy request returns the text it returned before. The proxy (in front of a
scripted node that records every call) gives the same answer, byte for byte, without calling a node.

Before (HEAD of issue 10 + the engine's failure isolation): a seed of 2^64, stop ids past the
vocabulary with min_tokens, a temperature of 1e-40 and a repetition penalty of 1e-38 failed their
request with a 500 (and took the engine thread down before that isolation); NaN / Infinity passed
the edge; stop id -1 silently banned the last token; nested JSON got a 500 from the proxy; nothing
bounded the body, list lengths, stop strings or prompt characters; the proxy passed stop ids, seeds and
over-long prompts on to a node.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from fake_node import FakeNode, ServerThread
from hostile_cases import ACCEPTED, BASE, CMPL, MAX_MODEL_LEN, MAX_REQUEST_BYTES, NODE_ONLY_REFUSED, REFUSED
from pdserve.engine.request_limits import RequestLimits
from pdserve.engine.text.tokenizer import load_tokenizer
from pdserve.proxy.app import build_app
from pdserve.proxy.config import ProxyConfig
from polling import wait_until

GREEDY = {**BASE, "temperature": 0}


@pytest.fixture(scope="module")
def node(node_factory, tiny_llama):
    return node_factory(tiny_llama, "--max-model-len", str(MAX_MODEL_LEN), "--max-request-bytes",
                        str(MAX_REQUEST_BYTES), "--num-gpu-blocks-override", "64")


@pytest.fixture(scope="module")
def greedy_text(node) -> str:
    return _post(node.url, CMPL, GREEDY).json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def fake():
    node = FakeNode(max_model_len=MAX_MODEL_LEN)
    yield node
    node.stop()


@pytest.fixture(scope="module")
def proxy(tiny_llama, fake):
    config = ProxyConfig(prefill_urls=(fake.url,), decode_urls=(fake.url,), model=str(tiny_llama),
                         limits=RequestLimits(max_request_bytes=MAX_REQUEST_BYTES))
    server = ServerThread(build_app(config, load_tokenizer(tiny_llama)))
    wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, 30, "proxy ready")
    yield server.url
    server.stop()


def _post(base: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(base + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(base + path, json=body, timeout=60)


def _check_refused(response: httpx.Response, status: int, words: list[str]) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]
    assert len(error["message"]) < 1000
    return error


@pytest.mark.parametrize("name, path, body, status, words", REFUSED + NODE_ONLY_REFUSED,
                         ids=[c[0] for c in REFUSED + NODE_ONLY_REFUSED])
def test_the_node_refuses_and_keeps_serving(node, greedy_text, name, path, body, status, words):
    _check_refused(_post(node.url, path, body), status, words)
    assert httpx.get(node.url + "/health").status_code == 200


@pytest.mark.parametrize("name, path, body, status, words", REFUSED, ids=[c[0] for c in REFUSED])
def test_the_proxy_refuses_with_the_nodes_answer_without_calling_a_node(node, proxy, fake, name, path, body,
                                                                        status, words):
    calls = len(fake.calls)
    from_proxy, from_node = _post(proxy, path, body), _post(node.url, path, body)
    assert (from_proxy.status_code, from_proxy.json()) == (from_node.status_code, from_node.json())
    _check_refused(from_proxy, status, words)
    assert len(fake.calls) == calls, "the proxy called a node for a request it must refuse"


@pytest.mark.parametrize("name, path, body, same_as_greedy", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_edge_values_the_node_accepts_run_to_completion(node, greedy_text, name, path, body, same_as_greedy):
    response = _post(node.url, path, body)
    assert response.status_code == 200, response.text[:500]
    choices = response.json()["choices"]
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    if same_as_greedy:
        assert choices[0]["text"] == greedy_text


def test_after_all_of_it_the_node_is_healthy_and_greedy_output_unchanged(node, greedy_text):
    assert httpx.get(node.url + "/health").status_code == 200
    assert _post(node.url, CMPL, GREEDY).json()["choices"][0]["text"] == greedy_text
    assert node.proc.poll() is None


def test_a_chunked_body_over_the_limit_is_refused_while_it_is_read(node, proxy):
    """No Content-Length: the limit holds as the body arrives (413 once it passes the limit)."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    for base in (node.url, proxy):
        r = httpx.post(base + CMPL, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
        _check_refused(r, 413, ["--max-request-bytes is 1048576"])


def test_a_huge_declared_body_is_refused_before_it_is_sent(node, proxy):
    """A client announcing 50 MB (and sending none of it) gets 413 at once: nothing waits for the body."""
    for base in (node.url, proxy):
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(f"POST {CMPL} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {50 << 20}\r\n\r\n{{".encode())
            head, _, body = _read_response(sock).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), head
        error = json.loads(body)["error"]
        assert "52428800 bytes" in error["message"] and error["code"] == "request_too_large"
    assert json.loads(_post(node.url, CMPL, GREEDY).text)["choices"]


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP response, read up to its Content-Length (the connection may stay open)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body
