"""The proxy's HTTP/1.1 client (``proxy/http1.py``, on asyncio and httptools) against a scripted raw-socket server: the
request on the wire, connection reuse, closing, pool limits and each failure kind. No timing in any assertion: a time limit
is only ever the outcome a test waits for."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdserve.proxy.http1 import ConnectFailed, ConnectionBroken, ConnectionPool, PoolTimeout, ReadTimeout
from pdserve.proxy.upstream import sse_batches


def chunked(*pieces: bytes, trailers: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n" + trailers + b"\r\n"


class Server:
    """Answers each request with the next scripted reply (bytes, or a coroutine function given the writer);
    records the requests it read and how many connections it accepted."""

    def __init__(self, replies: list):
        self.replies, self.requests, self.connections, self.closed = list(replies), [], 0, asyncio.Event()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                self.requests.append(head + await reader.readexactly(length))
                reply = self.replies.pop(0)
                if callable(reply):
                    await reply(reader, writer)
                else:
                    writer.write(reply)
            await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        self.closed.set()
        writer.close()


def ok(body: bytes, *headers: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), b"".join(h + b"\r\n" for h in headers),
                                                                    body)


def run(scenario):
    return asyncio.run(asyncio.wait_for(scenario(), 60))


def test_fetch_sends_one_request_and_reuses_the_connection():
    async def scenario():
        server = Server([ok(b'{"a": 1}'), ok(b"second", b"content-type: text/plain")])
        url = await server.start()
        pool = ConnectionPool(4, connect_timeout_s=5, timeout_s=30)
        first = await pool.fetch("POST", url + "/base/", "/v1/completions", b'{"x": 1}')
        second = await pool.fetch("GET", url, "/health")
        await pool.aclose()
        await server.stop()
        return server, first, second

    server, first, second = run(scenario)
    assert (first.status, first.content, second.content) == (200, b'{"a": 1}', b"second")
    assert second.headers["content-type"] == "text/plain"
    assert server.connections == 1                                    # kept alive
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /base/v1/completions HTTP/1.1\r\n") and body == b'{"x": 1}'
    assert b"content-type: application/json" in head.lower() and b"content-length: 8" in head.lower()
    assert server.requests[1].startswith(b"GET /health HTTP/1.1\r\n")
    assert b"content-length" not in server.requests[1].lower()


def test_a_chunked_stream_is_dechunked_and_the_connection_then_reused():
    body = chunked(b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n", trailers=b"x-trailer: 1\r\n")

    async def scenario():
        server = Server([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body, ok(b"again")])
        url = await server.start()
        pool = ConnectionPool(4, connect_timeout_s=5, timeout_s=30)
        response = await pool.stream("POST", url, "/v1/completions", b"{}")
        pieces = [p async for p in response.iter_bytes()]
        again = await pool.fetch("GET", url, "/health")
        await pool.aclose()
        await server.stop()
        return server, pieces, again

    server, pieces, again = run(scenario)
    assert b"".join(pieces) == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    assert again.content == b"again" and server.connections == 1


def test_closing_an_unread_stream_closes_its_connection():
    """What makes a node abort a request whose client went away."""
    async def hold(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"9\r\ndata: 1\n\n\r\n")

    async def scenario():
        server = Server([hold])
        url = await server.start()
        pool = ConnectionPool(4, connect_timeout_s=5, timeout_s=30)
        response = await pool.stream("POST", url, "/v1/completions", b"{}")
        first = await response.iter_bytes().__anext__()
        await response.aclose()
        await server.closed.wait()                                    # the server saw the hang-up
        await pool.aclose()
        await server.stop()
        return first

    assert run(scenario) == b"data: 1\n\n"


def test_each_failure_has_its_kind():
    async def cut(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        writer.transport.abort()

    async def silent(reader, writer):
        await reader.read()

    async def scenario():
        server = Server([cut, b"nonsense\r\n\r\n", silent])
        url = await server.start()
        pool = ConnectionPool(4, connect_timeout_s=5, timeout_s=0.2)
        kinds = []
        for _ in range(3):
            with pytest.raises((ConnectionBroken, ReadTimeout)) as info:
                await pool.fetch("POST", url, "/v1/completions", b"{}")
            kinds.append(type(info.value))
        closed = ConnectionPool(1, connect_timeout_s=5, timeout_s=5)
        await server.stop()
        with pytest.raises(ConnectFailed):
            await closed.fetch("GET", "http://127.0.0.1:1", "/health")
        await closed.aclose()
        await pool.aclose()
        return kinds

    assert run(scenario) == [ConnectionBroken, ConnectionBroken, ReadTimeout]


def test_the_pool_bounds_open_connections_and_hands_a_freed_one_on():
    async def scenario():
        gate = asyncio.Event()

        async def held(reader, writer):
            await gate.wait()
            writer.write(ok(b"late"))

        server = Server([held, ok(b"next")])
        url = await server.start()
        pool = ConnectionPool(1, connect_timeout_s=5, timeout_s=30)
        first = asyncio.ensure_future(pool.stream("POST", url, "/a", b"{}"))
        while not server.requests:
            await asyncio.sleep(0.01)
        pool.timeout_s = 0.2                                          # (the held call keeps its 30 s)
        with pytest.raises(PoolTimeout):                              # the only connection is busy
            await pool.fetch("GET", url, "/b")
        pool.timeout_s = 30
        waiting = asyncio.ensure_future(pool.fetch("GET", url, "/b"))
        gate.set()
        response = await first
        assert await response.read() == b"late"
        second = await waiting                                        # got the slot the first one freed
        await pool.aclose()
        await server.stop()
        return second.content

    assert run(scenario) == b"next"


def test_a_chunked_sse_body_cut_anywhere_arrives_whole():
    """Random cuts of a chunked SSE body, each written on its own: the same events, in order, each whole."""
    events = [b"data: %d %s\n\n" % (i, b"x" * i) for i in range(12)]
    body = chunked(*events)
    rng = random.Random(0)

    async def scenario(cuts: list[int]) -> list[list[bytes]]:
        async def trickle(reader, writer):
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
                writer.write(body[a:b])
                await writer.drain()
                await asyncio.sleep(0)

        server = Server([trickle])
        url = await server.start()
        pool = ConnectionPool(4, connect_timeout_s=5, timeout_s=30)
        response = await pool.stream("POST", url, "/v1/completions", b"{}")
        got = [batch async for batch in sse_batches(response.iter_bytes())]
        await pool.aclose()
        await server.stop()
        return got

    for _ in range(20):
        got = run(lambda: scenario(sorted(rng.sample(range(1, len(body)), 6))))
        assert [e for batch in got for e in batch] == events
