"""The proxy under load, against scripted fake nodes (``fake_node.FakeNode``) and an in-process proxy:
health probes that do not wait on the request pool, a stream that fails before its first token, busy
nodes (429 / 503 with Retry-After). Every wait is on a condition: held replies are released by the test.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from fake_node import FakeNode, Reply, ServerThread, error_event, role_chunk, tokens
from pdserve.engine.text.tokenizer import load_tokenizer
from pdserve.proxy.app import build_app
from pdserve.proxy.config import ProxyConfig
from polling import wait_until

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
BODIES = {CMPL: {"prompt": "Once upon a time", "max_tokens": 4},
          CHAT: {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 4}}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


@pytest.fixture
def fakes():
    started: list[FakeNode] = []

    def make(n: int) -> list[FakeNode]:
        nodes = [FakeNode() for _ in range(n)]
        started.extend(nodes)
        return nodes

    yield make
    for node in started:
        node.stop()


@pytest.fixture
def proxy(tiny_llama, tokenizer):
    """``proxy(prefill, decode, **config)``: an in-process proxy in front of the given fake nodes."""
    started: list[ServerThread] = []

    def start(prefill: list[FakeNode], decode: list[FakeNode], **config) -> str:
        cfg = ProxyConfig(prefill_urls=tuple(n.url for n in prefill), decode_urls=tuple(n.url for n in decode),
                          model=str(tiny_llama), **{"health_interval_s": 0.2, **config})
        server = ServerThread(build_app(cfg, tokenizer))
        started.append(server)
        wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, 30, "proxy ready")
        return server.url

    yield start
    for server in started:
        server.stop()


def test_probes_do_not_wait_on_the_request_pool(fakes, proxy):
    """Every pooled connection held by a slow node: the idle node keeps being probed and stays in rotation.
    Before: probes shared the request pool, timed out waiting for it, and took every node out."""
    slow, idle = fakes(2)
    url = proxy([slow], [slow, idle], max_node_connections=2)
    gates = [slow.script(CMPL, Reply(hold=True)).gate for _ in range(2)]
    answers: list[int] = []

    def ask() -> None:          # max_tokens=1, not streamed: the prefill node's answer is the answer
        answers.append(httpx.post(url + CMPL, json={**BODIES[CMPL], "max_tokens": 1}, timeout=60).status_code)

    threads = [threading.Thread(target=ask) for _ in gates]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(slow.posts(CMPL)) == 2, 30, "both requests held on the slow node: the pool is full")
        hits = idle.health_hits
        wait_until(lambda: idle.health_hits >= hits + 3, 20, "the idle node probed three more times")
        health = httpx.get(url + "/health")
        assert health.status_code == 200 and idle.url in health.json()["decode_healthy"]
    finally:
        for gate in gates:
            gate.set()
        for t in threads:
            t.join(timeout=60)
    assert answers == [200, 200]


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_a_server_error_before_the_first_token_is_retried_on_another_node(fakes, proxy, path):
    """HTTP 200, then an error event (after a chat stream's role chunk) and no token: the node failed,
    and nothing reached the client yet, so another decode node answers. Before: the client got the error."""
    prefill, d1, d2 = fakes(3)
    first, second = sorted((d1, d2), key=lambda n: n.url)      # round_robin tries them in URL order
    first.script(path, Reply(events=[role_chunk(), error_event()] if path == CHAT else [error_event()]))
    second.script(path, Reply(events=tokens(" fine", chat=path == CHAT)))
    url = proxy([prefill], [d1, d2], decode_policy="round_robin")
    payloads = _stream(url, path, BODIES[path])
    assert not any("error" in p for p in payloads)
    text = "".join(c.get("text") or c.get("delta", {}).get("content", "") for p in payloads for c in p["choices"])
    assert text == " fine"
    assert len(first.posts(path)) == len(second.posts(path)) == 1


def test_a_client_error_event_is_passed_on_not_retried(fakes, proxy):
    prefill, d1, d2 = fakes(3)
    for node in (d1, d2):
        node.script(CMPL, Reply(events=[error_event("invalid_request_error", "prompt too long")]))
    url = proxy([prefill], [d1, d2])
    payloads = _stream(url, CMPL, BODIES[CMPL])
    assert payloads[0]["error"]["message"] == "prompt too long"
    assert len(d1.posts(CMPL)) + len(d2.posts(CMPL)) == 1


@pytest.mark.parametrize("status", [429, 503])
def test_a_busy_node_is_tried_elsewhere(fakes, proxy, status):
    """429 / 503 with Retry-After from one prefill node: the other answers. Before: a 429 went to the client."""
    p1, p2, decode = fakes(3)
    first, second = sorted((p1, p2), key=lambda n: n.url)
    first.script(CMPL, Reply(status=status, headers={"Retry-After": "7"}))
    url = proxy([p1, p2], [decode], prefill_policy="round_robin")
    r = httpx.post(url + CMPL, json={**BODIES[CMPL], "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Hi"
    assert len(first.posts(CMPL)) == len(second.posts(CMPL)) == 1


@pytest.mark.parametrize("status", [429, 503])
def test_when_every_node_is_busy_the_client_gets_the_busy_answer(fakes, proxy, status):
    """Before: 429 passed on from the first node, 503 became 502 'after retries' without Retry-After."""
    p1, p2, decode = fakes(3)
    for node in (p1, p2):
        node.script(CMPL, Reply(status=status, headers={"Retry-After": "3"}))
    url = proxy([p1, p2], [decode])
    r = httpx.post(url + CMPL, json={**BODIES[CMPL], "max_tokens": 1}, timeout=60)
    assert r.status_code == status and r.headers["retry-after"] == "3"
    assert len(p1.posts(CMPL)) == len(p2.posts(CMPL)) == 1


def _stream(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("status", [500, 502])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_5xx_before_the_first_byte_is_retried_on_another_node(fakes, proxy, status, role):
    """Issue 15's untested rule: a node that answers 5xx before any byte reached the client is not the
    client's problem -- another node of the same role answers. Mutation caught: passing a 5xx through
    (before, only "connection refused" was injected, and a pass-through mutation survived every test)."""
    a, b, other = fakes(3)
    first, second = sorted((a, b), key=lambda n: n.url)
    first.script(CMPL, Reply(status=status))
    url = proxy([a, b], [other], prefill_policy="round_robin") if role == "prefill" else \
        proxy([other], [a, b], decode_policy="round_robin")
    body = {**BODIES[CMPL], "max_tokens": 1 if role == "prefill" else 4, "stream": role == "decode"}
    if role == "prefill":
        r = httpx.post(url + CMPL, json=body, timeout=60)
        assert r.status_code == 200, r.text
    else:
        assert not any("error" in p for p in _stream(url, CMPL, body))
    assert len(first.posts(CMPL)) == len(second.posts(CMPL)) == 1
