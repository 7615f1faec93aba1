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


def test_a_stream_closed_while_being_read_fails_its_reader_and_frees_one_slot():
    """aclose() from another task while a reader waits: the reader gets ConnectionBroken (not a body that
    looks whole), and the pool's one slot is freed once -- a second call still finds it bounded."""
    async def hold(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nfirst")     # ends at close
        await asyncio.sleep(30)

    async def scenario():
        server = Server([hold, hold])
        url = await server.start()
        pool = ConnectionPool(1, connect_timeout_s=5, timeout_s=30)
        response = await pool.stream("POST", url, "/a", b"{}")

        async def read_all():
            return [piece async for piece in response.iter_bytes()]

        reader = asyncio.ensure_future(read_all())
        while not response._conn.pieces and not reader.done():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        await response.aclose()
        with pytest.raises(ConnectionBroken):
            await reader
        first = await pool.stream("POST", url, "/b", b"{}")            # the one slot, free again
        pool.timeout_s = 0.2
        with pytest.raises(PoolTimeout):                               # and only one: not freed twice
            await pool.stream("POST", url, "/c", b"{}")
        await first.aclose()
        await pool.aclose()
        await server.stop()

    run(scenario)


def test_bytes_after_an_answer_are_not_part_of_it_and_the_connection_is_dropped():
    """A second answer in the same packet: the first stands as sent, the connection is not reused."""
    async def scenario():
        server = Server([ok(b"hi") + b"HTTP/1.1 200 OK\r\nx-smuggled: yes\r\ncontent-length: 5\r\n\r\nworld",
                         ok(b"next")])
        url = await server.start()
        pool = ConnectionPool(4, connect_timeout_s=5, timeout_s=30)
        first = await pool.fetch("GET", url, "/a")
        server.replies.insert(0, ok(b"next"))                         # the new connection's answer
        second = await pool.fetch("GET", url, "/b")
        await pool.aclose()
        await server.stop()
        return server, first, second

    server, first, second = run(scenario)
    assert (first.status, first.content, "x-smuggled" in first.headers) == (200, b"hi", False)
    assert second.content == b"next" and server.connections == 2


def test_an_interim_answer_is_skipped_and_a_head_answer_has_no_body():
    async def scenario():
        server = Server([b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + ok(b"real"),
                         b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n", ok(b"after")])
        url = await server.start()
        pool = ConnectionPool(4, connect_timeout_s=5, timeout_s=30)
        real = await pool.fetch("GET", url, "/a")
        head = await pool.fetch("HEAD", url, "/b")
        server.replies.insert(0, ok(b"after"))                        # HEAD's connection is not reused
        after = await pool.fetch("GET", url, "/c")
        await pool.aclose()
        await server.stop()
        return real, head, after

    real, head, after = run(scenario)
    assert (real.status, real.content, "link" in real.headers) == (200, b"real", False)
    assert (head.status, head.content, head.headers["content-length"]) == (200, b"", "10")
    assert after.content == b"after"


def test_credentials_in_a_node_url_go_in_authorization_not_host():
    async def scenario():
        server = Server([ok(b"")])
        url = await server.start()
        pool = ConnectionPool(4, connect_timeout_s=5, timeout_s=30)
        await pool.fetch("GET", url.replace("http://", "http://us%40er:s3cret@"), "/health")
        await pool.aclose()
        await server.stop()
        return server.requests[0].decode(), url.removeprefix("http://")

    head, netloc = run(scenario)
    assert f"\r\nHost: {netloc}\r\n" in head and "s3cret" not in head
    assert "\r\nAuthorization: Basic dXNAZXI6czNjcmV0\r\n" in head             # base64("us@er:s3cret")


def test_a_waiter_cancelled_as_its_slot_frees_stays_cancelled():
    """The client hangs up while its call waits for a free connection, in the same loop turn as one frees:
    the call raises CancelledError and never reaches the node (asyncio.wait_for on 3.11 lost the cancel)."""
    async def scenario():
        server = Server([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", ok(b"never")])
        url = await server.start()
        pool = ConnectionPool(1, connect_timeout_s=5, timeout_s=30)
        holder = await pool.stream("POST", url, "/holder", b"{}")
        waiter = asyncio.ensure_future(pool.fetch("POST", url, "/cancelled", b"{}"))
        await asyncio.sleep(0.05)
        await holder.aclose()                                          # the slot frees ...
        waiter.cancel()                                                # ... and the waiter is cancelled
        with pytest.raises(asyncio.CancelledError):
            await waiter
        again = await pool.stream("POST", url, "/again", b"{}")        # the slot was passed on, not lost
        await again.aclose()
        await asyncio.sleep(0.05)
        await pool.aclose()
        await server.stop()
        return server.requests

    requests = run(scenario)
    assert [r.split(b" ")[1] for r in requests] == [b"/holder", b"/again"]
