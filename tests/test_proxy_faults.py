"""Faults through the proxy, with real node processes: a client that hangs up, a decode node that
dies mid-stream, a node the probes take out, a node that died before the probes noticed."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from polling import wait_until
from test_proxy_support import proxy_factory, request, sse_payloads  # noqa: F401

PROMPT = "Once upon a time in a small village by the sea"
LONG = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
SHORT = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def nodes(tiny_llama, node_factory):
    """a stays up for the whole module; b and c are killed by the tests that use them."""
    return {name: node_factory(tiny_llama) for name in "abc"}


def metric(url: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(condition, timeout: float, what: str) -> None:
    wait_until(condition, timeout, what)


def idle(node_url: str) -> bool:
    return metric(node_url, "pdserve_num_requests_running") == 0 and \
        metric(node_url, "pdserve_num_requests_waiting") == 0


def test_client_disconnect_aborts_the_node_request(tiny_llama, nodes, proxy_factory):
    a = nodes["a"]
    proxy = proxy_factory(tiny_llama, [a.url], [a.url])
    aborted = metric(a.url, "pdserve_request_success_total", 'finished_reason="abort"')
    with httpx.stream("POST", proxy.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        seen = 0                                         # read 3 events, then hang up
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    wait_for(lambda: metric(a.url, "pdserve_request_success_total", 'finished_reason="abort"') > aborted,
             30, "node a counts the streaming request as aborted")
    wait_for(lambda: idle(a.url), 30, "node a has no running request")
    with pytest.raises(httpx.ReadTimeout):                   # non-streaming: the client gives up waiting
        request(proxy.url, "/v1/completions", {**LONG, "max_tokens": 1800}, timeout=httpx.Timeout(60, read=1.0))
    wait_for(lambda: metric(a.url, "pdserve_request_success_total", 'finished_reason="abort"') > aborted + 1,
             30, "node a counts the non-streaming request as aborted")
    wait_for(lambda: idle(a.url), 30, "node a has no running request")
    wait_for(lambda: metric(proxy.url, "pdserve_proxy_node_in_flight") == 0, 10, "the proxy has no lease left")
    assert metric(proxy.url, "pdserve_proxy_requests_total", 'outcome="aborted"') == 2


def test_stream_broken_by_a_dying_node_ends_with_an_error_event(tiny_llama, nodes, proxy_factory):
    a, c = nodes["a"], nodes["c"]
    only_c = proxy_factory(tiny_llama, [a.url], [c.url])
    pooled = proxy_factory(tiny_llama, [a.url, c.url], [a.url, c.url], "--health-interval", "0.5",
                           "--prefill-policy", "round_robin", "--decode-policy", "round_robin")
    wait_for(lambda: sorted(httpx.get(pooled.url + "/health").json()["decode_healthy"]) == sorted([a.url, c.url]),
             10, "the pooled proxy has seen c healthy (else dropping it below proves nothing)")
    with httpx.stream("POST", only_c.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        c.proc.kill()
        tail = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert tail[-1] == "[DONE]"
    error = json.loads(tail[-2])["error"]
    assert c.url in error["message"] and "mid-stream" in error["message"]
    assert metric(only_c.url, "pdserve_proxy_requests_total", 'outcome="stream_error"') == 1

    # the prober takes c out within 5 s (probes every 0.5 s); then every request goes to a
    wait_for(lambda: httpx.get(pooled.url + "/health").json()["decode_healthy"] == [a.url], 5,
             "the proxy stops routing to the killed node")
    expected = request(a.url, "/v1/completions", SHORT).json()["choices"]
    for _ in range(4):
        r = request(pooled.url, "/v1/completions", SHORT)
        assert r.status_code == 200 and r.json()["choices"] == expected


def test_node_dead_before_the_probes_noticed_is_retried_elsewhere(tiny_llama, nodes, proxy_factory):
    a, b = nodes["a"], nodes["b"]
    proxy = proxy_factory(tiny_llama, [a.url, b.url], [a.url, b.url], "--health-interval", "60",
                          "--prefill-policy", "round_robin", "--decode-policy", "round_robin")
    b.proc.kill()
    b.proc.wait()
    expected = request(a.url, "/v1/completions", SHORT).json()["choices"]
    for stream in (False, True, False):                      # round robin: each phase meets b once
        body = {**SHORT, "stream": stream}
        if stream:
            with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                text = "".join(p["choices"][0]["text"] for p in sse_payloads(r) if p["choices"])
            assert text == expected[0]["text"]
        else:
            r = request(proxy.url, "/v1/completions", body)
            assert r.status_code == 200 and r.json()["choices"] == expected
    assert metric(proxy.url, "pdserve_proxy_retries_total", 'role="prefill"') >= 1
    assert metric(proxy.url, "pdserve_proxy_retries_total", 'role="decode"') >= 1
    health = httpx.get(proxy.url + "/health").json()
    assert health["prefill_healthy"] == health["decode_healthy"] == [a.url]
