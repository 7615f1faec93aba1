"""Connections (issue 11): a bounded number of requests in flight per node (503 + Retry-After beyond it,
which the proxy tries elsewhere), and idle or half-open connections that never starve real clients."""

from __future__ import annotations

import asyncio
import socket

import httpx

from pdserve.engine.server.inflight import InflightLimit


def test_inflight_limit_answers_503_with_retry_after_and_frees_its_slots():
    """Requests are held inside the app until released: no timing. Mutation caught: without the
    middleware the third request is served (200), and a leaked slot would refuse the fourth."""
    release, entered = asyncio.Event(), []

    async def app(scope, receive, send):
        entered.append(scope["path"])
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    limited = InflightLimit(app, max_inflight=2)

    async def call(path: str) -> tuple[int, dict, bytes]:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message):
            sent.append(message)

        await limited({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body

    async def main():
        held = [asyncio.create_task(call("/v1/completions")) for _ in range(2)]
        while len(entered) < 2:
            await asyncio.sleep(0)
        third = await call("/v1/chat/completions")
        health_task = asyncio.create_task(call("/health"))    # not a generation route: never limited
        while len(entered) < 3:
            await asyncio.sleep(0)
        release.set()
        done = await asyncio.gather(*held, health_task)
        fourth = await call("/v1/completions")
        return third, done, fourth

    third, done, fourth = asyncio.run(main())
    status, headers, body = third
    assert status == 503 and headers["retry-after"] == "1"
    assert b"--max-inflight-requests is 2" in body
    assert [d[0] for d in done] == [200, 200, 200] and fourth[0] == 200
    assert limited.inflight == 0 and limited.rejected == 1


def test_two_hundred_idle_and_half_open_connections_do_not_starve_a_client(node_factory, tiny_llama):
    node = node_factory(tiny_llama, "--max-inflight-requests", "8")
    port = int(node.url.rsplit(":", 1)[1])
    idle = []
    try:
        for i in range(200):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 2:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")   # body never ends
            else:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")                                 # headers never end
            idle.append(s)
        r = httpx.post(node.url + "/v1/completions", timeout=30,
                       json={"prompt": "hello", "max_tokens": 4, "temperature": 0.0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(node.url + "/health", timeout=30).status_code == 200
    finally:
        for s in idle:
            s.close()
