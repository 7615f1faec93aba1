"""No request outlives its node's health (issue 35): calls in flight on a node the probes take out of rotation
fail at once -- retried on another node while nothing reached the client, 503 + Retry-After with none left, an
error event on a stream under way -- instead of waiting for --request-timeout; the node is used again once it
answers its probes. Scripted fake nodes hold their answers (``Reply(hold=...)``) and "freeze" by holding their
/health answer (``health_status = None``, what a SIGSTOPped process does); an in-process proxy probes every
0.2 s. Before the fix each held request below waited for the test's client timeout.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from conftest import free_port
from fake_node import FakeNode, Reply, stream_of
from pdserve.proxy.health import HealthChecker
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.router import NodePool
from polling import wait_until
from test_proxy_under_load import fakes, proxy, tokenizer  # noqa: F401 -- fixtures

CMPL = "/v1/completions"
BODY = {"prompt": "Once upon a time", "max_tokens": 4}
CLIENT_TIMEOUT_S = 30          # far beyond a few 0.2 s probe rounds; the old code waited for the node's answer


class Ask(threading.Thread):
    """One request to the proxy from a thread: ``.result`` is (status, headers, SSE data lines or JSON)."""

    def __init__(self, url: str, stream: bool):
        super().__init__(daemon=True)
        self.url, self.stream, self.result, self.error = url, stream, None, None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + CMPL, json={**BODY, "stream": self.stream},
                              timeout=CLIENT_TIMEOUT_S) as r:
                r.read()
                data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")] if \
                    r.status_code == 200 and self.stream else r.json()
                self.result = (r.status_code, r.headers, data)
        except Exception as exc:         # noqa: BLE001 -- reported by answer()
            self.error = exc

    def answer(self):
        self.join(CLIENT_TIMEOUT_S + 30)
        assert self.error is None, f"the request failed on the client side: {self.error!r}"
        assert self.result is not None, "no answer"
        return self.result


def metric(url: str, name: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def healthy(url: str, role: str = "decode") -> list[str]:
    return httpx.get(url + "/health", timeout=10).json()[f"{role}_healthy"]


def unfreeze_and_check_used_again(url: str, node: FakeNode, others: int, role: str = "decode") -> None:
    """``node`` answers its probes again: back in rotation, and round robin gives it a request that succeeds."""
    node.health_status = 200
    wait_until(lambda: node.url in healthy(url, role), 30, f"{node.url} back in rotation")
    before = len(node.posts(CMPL))
    for _ in range(others + 1):
        r = httpx.post(url + CMPL, json=BODY, timeout=CLIENT_TIMEOUT_S)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hi", r.text
    assert len(node.posts(CMPL)) == before + 1


@pytest.mark.parametrize("role,stream", [("decode", False), ("decode", True), ("prefill", False)])
def test_a_call_held_on_a_node_taken_out_is_retried_on_another(fakes, proxy, role, stream):
    """A node holds the request (a decode stream: before its first byte), then stops answering its probes: the
    proxy hangs up on it and the other node of its role answers. Then the first is used again."""
    other_role, a, b = fakes(3)
    first, second = sorted((a, b), key=lambda n: n.url)        # round robin tries them in URL order
    held = first.script(CMPL, Reply(hold=True))
    url = proxy([other_role], [a, b], decode_policy="round_robin") if role == "decode" else \
        proxy([a, b], [other_role], prefill_policy="round_robin")
    ask = Ask(url, stream)
    wait_until(lambda: len(first.posts(CMPL)) == 1, 30, f"the request held on the first {role} node")
    first.health_status = None                                  # frozen
    status, _, data = ask.answer()
    assert status == 200
    text = "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) if stream else data["choices"][0]["text"]
    assert text == "Hi" and (data[-1] == "[DONE]" if stream else True)
    assert len(second.posts(CMPL)) == 1
    wait_until(held.gone.is_set, 30, "the proxy hung up on the frozen node (a node aborts such a request)")
    assert metric(url, "pdserve_proxy_aborted_calls_total") == 1
    unfreeze_and_check_used_again(url, first, others=1, role=role)


@pytest.mark.parametrize("stream", [False, True])
def test_with_no_other_node_the_held_call_gets_503_with_retry_after(fakes, proxy, stream):
    prefill, decode = fakes(2)
    held = decode.script(CMPL, Reply(hold=True))
    url = proxy([prefill], [decode])
    ask = Ask(url, stream)
    wait_until(lambda: len(decode.posts(CMPL)) == 1, 30, "the request held on the decode node")
    decode.health_status = None
    status, headers, data = ask.answer()
    assert status == 503 and headers["retry-after"] == "1", (status, data)
    assert decode.url in data["error"]["message"] and "taken out of rotation" in data["error"]["message"]
    wait_until(held.gone.is_set, 30, "the proxy hung up on the frozen node")
    r = httpx.post(url + CMPL, json=BODY, timeout=CLIENT_TIMEOUT_S)          # the proxy keeps answering
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    unfreeze_and_check_used_again(url, decode, others=0)


def test_a_stream_under_way_ends_with_an_error_event(fakes, proxy):
    """The first token reached the client, then the node froze: one error event naming the node, [DONE]."""
    prefill, decode = fakes(2)
    held = decode.script(CMPL, Reply(events=stream_of([" one", " two"]), hold_after=1))
    url = proxy([prefill], [decode])
    with httpx.stream("POST", url + CMPL, json={**BODY, "stream": True}, timeout=CLIENT_TIMEOUT_S) as r:
        events = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(next(events))["choices"][0]["text"] == " one"
        decode.health_status = None
        tail = list(events)
    assert len(tail) == 2 and tail[1] == "[DONE]", tail
    error = json.loads(tail[0])["error"]
    assert decode.url in error["message"] and "taken out of rotation" in error["message"], error
    wait_until(held.gone.is_set, 30, "the proxy hung up on the frozen node")
    wait_until(lambda: metric(url, "pdserve_proxy_node_in_flight") == 0, 30, "no lease left")
    unfreeze_and_check_used_again(url, decode, others=0)


def test_a_node_answering_503_to_its_probe_also_has_its_calls_failed(fakes, proxy):
    """Not only silence: a node that says it is unhealthy has its held calls retried elsewhere."""
    prefill, d1, d2 = fakes(3)
    first, second = sorted((d1, d2), key=lambda n: n.url)
    first.script(CMPL, Reply(hold=True))
    url = proxy([prefill], [d1, d2], decode_policy="round_robin")
    ask = Ask(url, stream=False)
    wait_until(lambda: len(first.posts(CMPL)) == 1, 30, "the request held on the first decode node")
    first.health_status = 503
    assert ask.answer()[0] == 200 and len(second.posts(CMPL)) == 1


def test_a_probe_fails_calls_unless_the_connection_was_refused(fakes):
    """``on_down`` for a node that answered 503 and one that did not answer in time; not for one that refused the
    connection -- nothing listens there: gone (its connections were reset with it) or draining (its calls go on)."""
    unhealthy, frozen = fakes(2)
    unhealthy.health_status, frozen.health_status = 503, None
    refused = f"http://127.0.0.1:{free_port()}"
    pool = NodePool("decode", (unhealthy.url, frozen.url, refused), "round_robin", ProxyMetrics())
    downs: list[tuple[str, float, str]] = []

    async def probe_once() -> float:
        checker = HealthChecker([pool], interval_s=1.0, timeout_s=0.5,
                                on_down=lambda node, since, why: downs.append((node.url, since, why)))
        sent = time.monotonic()
        await checker.probe_all()
        await checker.stop()
        return sent

    sent = asyncio.run(probe_once())
    assert pool.healthy == []
    assert sorted(url for url, _, _ in downs) == sorted([unhealthy.url, frozen.url])
    assert all(since >= sent for _, since, _ in downs)
    whys = {url: why for url, _, why in downs}
    assert "503" in whys[unhealthy.url] and "ReadTimeout" in whys[frozen.url]
