"""Faults through a real `pdserve proxy` process: a client that hangs up, a decode node that dies
mid-stream, a node the probes take out, a node that died before the probes noticed.

A fault that must land while a request is in flight lands on a scripted node (``fake_node.FakeNode``)
that holds its answer until the test releases it: the test waits for "the proxy is streaming from
node X" instead of hoping that a generation outlasts a kill or a hang-up. Nodes that are killed
between requests are real `pdserve node` processes. That a node aborts a request whose connection
closed is test_server.py's (``test_client_*_aborts_the_request``).
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from fake_node import FakeNode, Reply, stream_of
from polling import wait_until
from test_proxy_support import proxy_factory, request, sse_payloads  # noqa: F401

CMPL = "/v1/completions"
PROMPT = "Once upon a time in a small village by the sea"
SHORT = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def nodes(tiny_llama, node_factory):
    """a stays up for the whole module; b and c are killed by the tests that use them."""
    return {name: node_factory(tiny_llama) for name in "abc"}


@pytest.fixture
def fakes():
    started: list[FakeNode] = []

    def make(n: int) -> list[FakeNode]:
        started.extend(FakeNode() for _ in range(n))
        return started[-n:]

    yield make
    for node in started:
        node.stop()


def metric(url: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _hang_up_once(url: str, body: dict, reached) -> None:
    """POST ``body`` to the proxy on a raw socket; close it (the client hangs up) once ``reached()``."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {CMPL} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        wait_until(reached, 30, "the node is holding the request")


def test_a_client_that_hangs_up_gets_the_node_call_closed(tiny_llama, fakes, proxy_factory):
    """The client hangs up while a node holds its answer -- mid-stream, before a non-streamed decode answer,
    before the prefill answer: the proxy closes exactly that node call (which makes a node abort the request),
    calls no node after it, counts each request "aborted" and keeps no lease.
    Mutations caught: ``_unless_disconnected`` (proxy/app.py) awaiting the work instead of racing the
    disconnect -> the held non-streamed calls are never closed; ``RelayResponse.__call__``
    (proxy/orchestrate.py) without ``self._stream.aclose()`` -> the stream's lease is never released."""
    prefill, decode = fakes(2)
    proxy = proxy_factory(tiny_llama, [prefill.url], [decode.url])
    body = {"prompt": PROMPT, "max_tokens": 4}

    mid_stream = decode.script(CMPL, Reply(events=stream_of([" one", " two"]), hold_after=1))
    with httpx.stream("POST", proxy.url + CMPL, json={**body, "stream": True}, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["choices"][0]["text"] == " one"
    wait_until(mid_stream.gone.is_set, 30, "the decode node's stream closed after the client hung up")

    held_decode = decode.script(CMPL, Reply(hold=True))
    _hang_up_once(proxy.url, body, lambda: len(decode.posts(CMPL)) == 2)
    wait_until(held_decode.gone.is_set, 30, "the decode call closed after the client hung up")

    held_prefill = prefill.script(CMPL, Reply(hold=True))
    _hang_up_once(proxy.url, body, lambda: len(prefill.posts(CMPL)) == 3)
    wait_until(held_prefill.gone.is_set, 30, "the prefill call closed after the client hung up")

    assert len(prefill.posts(CMPL)) == 3 and len(decode.posts(CMPL)) == 2      # no decode after a prefill hang-up
    wait_until(lambda: metric(proxy.url, "pdserve_proxy_requests_total", 'outcome="aborted"') == 3, 30,
               "three requests counted as aborted")
    assert metric(proxy.url, "pdserve_proxy_requests_total") == 3
    assert metric(proxy.url, "pdserve_proxy_node_in_flight") == 0


def test_stream_broken_by_a_dying_node_ends_with_an_error_event(tiny_llama, fakes, proxy_factory):
    """The decode node's connection is cut after its first token reached the client (the node is held
    there until then): the client's stream ends with one error event naming the node, then [DONE].
    Mutation caught: ``RelayResponse._relay`` (proxy/orchestrate.py) catching ``httpx.TimeoutException``
    instead of ``httpx.HTTPError`` -> the client's stream breaks off with no error event and no [DONE]."""
    prefill, c = fakes(2)
    proxy = proxy_factory(tiny_llama, [prefill.url], [c.url])
    dying = c.script(CMPL, Reply(events=stream_of([" one", " two"]), hold_after=1, die=True))
    with httpx.stream("POST", proxy.url + CMPL, json={**SHORT, "stream": True}, timeout=60) as r:
        events = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(next(events))["choices"][0]["text"] == " one"
        dying.gate.set()                                   # now the node dies
        tail = list(events)
    assert len(tail) == 2 and tail[1] == "[DONE]", tail
    error = json.loads(tail[0])["error"]
    assert c.url in error["message"] and "mid-stream" in error["message"]
    assert error["type"] == "server_error" and not dying.gone.is_set()
    wait_until(lambda: metric(proxy.url, "pdserve_proxy_requests_total", 'outcome="stream_error"') == 1, 30,
               "the broken stream counted once")
    assert metric(proxy.url, "pdserve_proxy_node_in_flight") == 0


def test_a_killed_node_is_taken_out_by_the_probes(tiny_llama, nodes, proxy_factory):
    """c is seen healthy, then SIGKILLed: the prober (every 0.5 s) takes it out and every request goes to a."""
    a, c = nodes["a"], nodes["c"]
    pooled = proxy_factory(tiny_llama, [a.url, c.url], [a.url, c.url], "--health-interval", "0.5",
                           "--prefill-policy", "round_robin", "--decode-policy", "round_robin")
    wait_until(lambda: sorted(httpx.get(pooled.url + "/health").json()["decode_healthy"]) == sorted([a.url, c.url]),
               30, "the pooled proxy has seen c healthy (else dropping it below proves nothing)")
    c.proc.kill()
    c.proc.wait()
    wait_until(lambda: httpx.get(pooled.url + "/health").json()["decode_healthy"] == [a.url], 30,
               "the proxy stops routing to the killed node")
    expected = request(a.url, CMPL, SHORT).json()["choices"]
    for _ in range(4):
        r = request(pooled.url, CMPL, SHORT)
        assert r.status_code == 200 and r.json()["choices"] == expected
    assert metric(pooled.url, "pdserve_proxy_retries_total") == 0      # the probes, not retries, routed around c


def test_node_dead_before_the_probes_noticed_is_retried_elsewhere(tiny_llama, nodes, proxy_factory):
    a, b = nodes["a"], nodes["b"]
    proxy = proxy_factory(tiny_llama, [a.url, b.url], [a.url, b.url], "--health-interval", "60",
                          "--prefill-policy", "round_robin", "--decode-policy", "round_robin")
    b.proc.kill()
    b.proc.wait()
    expected = request(a.url, CMPL, SHORT).json()["choices"]
    for stream in (False, True, False):                      # round robin: each phase meets b once
        body = {**SHORT, "stream": stream}
        if stream:
            with httpx.stream("POST", proxy.url + CMPL, json=body, timeout=60) as r:
                assert r.status_code == 200
                text = "".join(p["choices"][0]["text"] for p in sse_payloads(r) if p["choices"])
            assert text == expected[0]["text"]
        else:
            r = request(proxy.url, CMPL, body)
            assert r.status_code == 200 and r.json()["choices"] == expected
    assert metric(proxy.url, "pdserve_proxy_retries_total", 'role="prefill"') >= 1
    assert metric(proxy.url, "pdserve_proxy_retries_total", 'role="decode"') >= 1
    health = httpx.get(proxy.url + "/health").json()
    assert health["prefill_healthy"] == health["decode_healthy"] == [a.url]
