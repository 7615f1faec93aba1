"""A real decode node frozen (SIGSTOP) and resumed (SIGCONT) under a real cluster (issue 35), marked slow (about a
minute each; ``pytest -m slow tests/test_proxy_frozen_node.py``): one prefill node, two decode nodes (or one),
the proxy probing every 0.5 s (``--decode-policy round_robin``).

- A stream and a non-streamed request in flight on the node when it freezes: the stream gets an error event and
  ``[DONE]``, the other request is answered by the other decode node; once resumed the node serves again.
- 64 streaming clients while a decode node freezes for longer than their read timeout, then resumes: no client
  sees a cut connection or a timeout -- every request ends in a whole stream, a stream with an error event (it was
  under way on the frozen node) or a 503 with ``Retry-After``; the node serves again after SIGCONT.

Before: calls in flight on the frozen node waited for it (up to ``--request-timeout``, 600 s), so the clients'
reads timed out; requests sent on kept-alive connections while it was stopped were reset as it resumed (502).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections import Counter

import httpx
import pytest

from pdserve.proxy.cluster import ClusterSpec, LocalCluster
from polling import wait_until

pytestmark = pytest.mark.slow
CMPL = "/v1/completions"
READ_TIMEOUT_S = 10.0                  # a client's patience; the node stays frozen longer
FREEZE_S = 15.0


def _cluster(model, decode: int):
    flags = ("--health-interval", "0.5", "--decode-policy", "round_robin")
    return LocalCluster(str(model), ClusterSpec(prefill=1, decode=decode, proxy_flags=flags))


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    with _cluster(tiny_llama, decode=2) as running:
        yield running


@pytest.fixture(scope="module")
def single_decode_cluster(tiny_llama):
    with _cluster(tiny_llama, decode=1) as running:
        yield running


def decode_child(cluster: LocalCluster, first: bool):
    """The decode node round robin tries first (URL order), or the last one."""
    ordered = sorted((c for c in cluster.children if c.name.startswith("decode")), key=lambda c: c.url)
    return ordered[0] if first else ordered[-1]


def healthy_decode(cluster: LocalCluster) -> list[str]:
    return httpx.get(cluster.url + "/health", timeout=10).json()["decode_healthy"]


def metric(url: str, prefix: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix))


def resume(cluster: LocalCluster, node) -> None:
    os.kill(node.proc.pid, signal.SIGCONT)
    wait_until(lambda: node.url in healthy_decode(cluster), 60, f"{node.url} back in rotation")


def test_calls_in_flight_on_a_frozen_decode_node_end_and_it_serves_again(cluster):
    frozen = decode_child(cluster, first=True)
    long = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    wait_until(lambda: len(healthy_decode(cluster)) == 2, 60, "both decode nodes in rotation")
    aborted = metric(cluster.url, "pdserve_proxy_aborted_calls_total")
    with httpx.stream("POST", cluster.url + CMPL, json={**long, "stream": True}, timeout=60) as r:
        lines = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
        assert "choices" in json.loads(next(lines))          # under way on the first decode node
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        try:
            tail = list(lines)
        finally:
            resume(cluster, frozen)
    assert tail[-1] == "[DONE]" and frozen.url in json.loads(tail[-2])["error"]["message"], tail[-3:]

    short = {"prompt": "hi", "max_tokens": 4}
    assert httpx.post(cluster.url + CMPL, json=short, timeout=60).status_code == 200    # round robin: the second
    answers: list[httpx.Response] = []
    ask = threading.Thread(target=lambda: answers.append(httpx.post(cluster.url + CMPL, json=long, timeout=60)))
    ask.start()                                                                          # ... and the first again
    in_flight = f'pdserve_proxy_node_in_flight{{node="{frozen.url}",role="decode"}}'
    wait_until(lambda: metric(cluster.url, in_flight) == 1, 60, "the long request in flight on the first decode node")
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        ask.join(60)
    finally:
        resume(cluster, frozen)
    assert answers and answers[0].status_code == 200, answers
    assert metric(cluster.url, "pdserve_proxy_aborted_calls_total") == aborted + 2

    served = metric(frozen.url, "vllm:request_success_total")
    for _ in range(2):                     # round robin: one of the two goes to the resumed node
        assert httpx.post(cluster.url + CMPL, json=short, timeout=60).status_code == 200
    assert metric(frozen.url, "vllm:request_success_total") > served


class Clients:
    """64 streaming clients on one httpx pool; each request's outcome counted by kind."""

    def __init__(self, url: str, count: int = 64):
        self.url, self.count, self.outcomes, self.failures = url, count, Counter(), []
        self.stop = False

    async def run(self, controller) -> None:
        limits = httpx.Limits(max_connections=self.count, max_keepalive_connections=self.count)
        timeout = httpx.Timeout(60, read=READ_TIMEOUT_S)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            await asyncio.gather(controller, *(self._worker(client, i) for i in range(self.count)))

    async def _worker(self, client: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not self.stop:
            n += 1
            body = {"prompt": f"client {i} asks question {n}", "max_tokens": 16, "temperature": 0, "stream": True}
            try:
                await self._one(client, body)
            except Exception as exc:        # noqa: BLE001 -- what the test is about: none may happen
                self.outcomes["client exception"] += 1
                self.failures.append(f"{type(exc).__name__}: {exc!r}"[:300])

    async def _one(self, client: httpx.AsyncClient, body: dict) -> None:
        async with client.stream("POST", self.url + CMPL, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                self.outcomes[f"{r.status_code} retry-after={r.headers.get('retry-after')}"] += 1
                if r.status_code == 503 and r.headers.get("retry-after"):
                    await asyncio.sleep(float(r.headers["retry-after"]))       # what a polite client does
                return
            data = [line[len("data: "):] async for line in r.aiter_lines() if line.startswith("data: ")]
        kind = "no [DONE]" if not data or data[-1] != "[DONE]" else "error event" if '"error"' in data[-2] else "ok"
        self.outcomes[kind] += 1


@pytest.mark.parametrize("decode_nodes", [2, 1])
def test_64_streaming_clients_through_a_decode_node_frozen_and_resumed(request, decode_nodes):
    """With one decode node, the proxy answers 503 + Retry-After while it is frozen."""
    cluster = request.getfixturevalue("cluster" if decode_nodes == 2 else "single_decode_cluster")
    frozen = decode_child(cluster, first=False) if decode_nodes == 2 else decode_child(cluster, first=True)
    wait_until(lambda: len(healthy_decode(cluster)) == decode_nodes, 60, "every decode node in rotation")
    clients = Clients(cluster.url)
    served: list[float] = []

    async def controller() -> None:
        while clients.outcomes["ok"] < 64:
            await asyncio.sleep(0.05)
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(FREEZE_S)                 # the scenario: frozen longer than a client's read timeout
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        served.append(await asyncio.to_thread(metric, frozen.url, "vllm:request_success_total"))
        ok_at_resume = clients.outcomes["ok"]
        while clients.outcomes["ok"] < ok_at_resume + 256:
            await asyncio.sleep(0.05)
        clients.stop = True

    started = time.monotonic()
    asyncio.run(clients.run(controller()))
    outcomes = dict(clients.outcomes)
    print(f"{sum(outcomes.values())} requests in {time.monotonic() - started:.0f} s: {outcomes}; calls aborted: "
          f"{metric(cluster.url, 'pdserve_proxy_aborted_calls_total'):.0f}, retried: "
          f"{metric(cluster.url, 'pdserve_proxy_retries_total'):.0f}")
    assert not clients.failures, (outcomes, clients.failures[:5])
    assert set(outcomes) <= {"ok", "error event", "503 retry-after=1"}, outcomes
    assert outcomes.get("error event", 0) <= 64, outcomes             # only streams under way on the frozen node
    assert metric(frozen.url, "vllm:request_success_total") > served[0]     # the resumed node served again
