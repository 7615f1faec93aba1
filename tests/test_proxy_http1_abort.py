"""The node client's part in "no request outlives its node's health" (``proxy/http1.py``), against the scripted
raw-socket server of test_proxy_overhead_client.py: ``abort_silent`` fails exactly the calls that heard nothing
since a given time; a kept-alive connection that the node resets before any byte of its answer is retried once on
a new connection, and nothing else is. No timing in any assertion."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.proxy.http1 import CallAborted, ConnectionBroken, ConnectionPool
from test_proxy_overhead_client import Server, ok, run


def test_abort_silent_fails_the_silent_call_and_spares_the_one_that_hears_from_its_node():
    gate = asyncio.Event()

    async def silent(reader, writer):
        await gate.wait()

    async def chatty(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await gate.wait()
        writer.write(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")

    async def scenario():
        server = Server([silent, chatty])
        url = await server.start()
        pool = ConnectionPool(4, connect_timeout_s=5, timeout_s=30)
        held = asyncio.ensure_future(pool.fetch("POST", url, "/v1/completions", b"{}"))
        while len(server.requests) < 1:
            await asyncio.sleep(0.01)
        since = time.monotonic()
        stream = await pool.stream("POST", url, "/v1/completions", b"{}")     # its head and a chunk: after since
        pieces = stream.iter_bytes()
        first = await pieces.__anext__()
        aborted = pool.abort_silent(url, since, "taken out of rotation")
        with pytest.raises(CallAborted, match="taken out of rotation"):
            await held
        gate.set()
        rest = [p async for p in pieces]
        nobody = pool.abort_silent("http://127.0.0.1:1", since, "never called")
        await pool.aclose()
        await server.stop()
        return aborted, first + b"".join(rest), nobody

    aborted, body, nobody = run(scenario)
    assert aborted == 1 and nobody == 0
    assert body == b"data: 1\n\ndata: 2\n\n"


async def _reset(reader, writer):
    writer.transport.abort()                     # RST, no byte of an answer: a keep-alive that ran out as it came


async def _half_then_close(reader, writer):
    writer.write(b"HTTP/1.1 200 OK\r\n")       # an answer begun, then the connection closed (FIN: the bytes
    writer.close()                               # arrive first; a reset could discard them unread)


def _second_request(case: str):
    """The outcome of a request whose connection is reset, and how many connections the server accepted."""
    first = [] if case == "fresh_reset" else [ok(b"first")]
    breaking = _half_then_close if case == "reused_half_answer" else _reset

    async def scenario():
        server = Server([*first, breaking, ok(b"second")])
        url = await server.start()
        pool = ConnectionPool(4, connect_timeout_s=5, timeout_s=30)
        if first:
            assert (await pool.fetch("POST", url, "/v1/completions", b"{}")).content == b"first"
        try:
            outcome = (await pool.fetch("POST", url, "/v1/completions", b"{}")).content
        except ConnectionBroken as exc:
            outcome = exc
        await pool.aclose()
        await server.stop()
        return outcome, server.connections

    return run(scenario)


def test_only_a_kept_alive_connection_reset_before_its_answer_is_retried():
    """The second request goes out on the kept-alive connection, which the node resets unread: sent again on a
    new connection, answered (before: ConnectionBroken, and the proxy took the node out of rotation). Not retried:
    a connection that broke after the node began its answer (it saw the request), nor a new connection reset."""
    assert _second_request("reused_reset") == (b"second", 2)
    for case in ("reused_half_answer", "fresh_reset"):
        outcome, connections = _second_request(case)
        assert isinstance(outcome, ConnectionBroken) and connections == 1, (case, outcome, connections)
