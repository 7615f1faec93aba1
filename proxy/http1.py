"""The proxy's HTTP/1.1 client for node calls: kept-alive connections, answers parsed by httptools.

Used by ``upstream`` (one pool for requests, ``--max-node-connections``) and ``health`` (a small pool of
its own for probes):

    pool = ConnectionPool(max_connections=1024, connect_timeout_s=2.0, timeout_s=600.0)
    reply = await pool.fetch("POST", "http://127.0.0.1:8100", "/v1/completions", body_bytes)
    reply.status, reply.headers, reply.content     # headers: lower-case name -> value
    response = await pool.stream("POST", base_url, path, body_bytes)   # status and headers read
    async for piece in response.iter_bytes(): ...  # the body as it arrives, de-chunked
    await response.aclose()                        # before the body's end: closes the connection -- the node
                                                   # sees the hang-up and aborts the request
    await pool.aclose()

Each connection is an ``asyncio.Protocol`` whose bytes go straight into httptools' response parser (llhttp,
the parser uvicorn serves with): one write per request, no task per call. A node call costs ~50 us of CPU
here against ~200 us through aiohttp and ~760 us through httpx (``devbench/proxy_overhead.py`` measures what
the proxy adds to a request; two node calls per client request).

Ownership: everything runs on the one event loop that first used the pool. A connection carries one
request at a time: ``stream``/``fetch`` take it (and a slot of ``max_connections``) and give it back, to the
origin's idle list, only once its answer was read to the end and the node offered keep-alive; any other
ending closes it. A stream's reader that falls behind pauses the socket (``_HIGH_WATER`` bytes buffered).

Time limits: ``connect_timeout_s`` for a new connection; ``timeout_s`` for a free connection, for a whole
``fetch`` (free connection, write, head, body), for a ``stream``'s head and for each of its reads. Failures
are ``HTTPError``s: ``ConnectFailed`` (unreachable, connect timeout; ``ConnectRefused``: refused),
``PoolTimeout`` (every connection busy), ``ReadTimeout`` (no progress: a stalled write is not told from a
silent node, so ``WriteTimeout`` is kept for callers but not raised), ``ConnectionBroken`` (the node closed or
reset the connection, or did not answer HTTP/1.1), ``CallAborted`` (``abort_silent``: the caller gave up on a
node that went silent). A connection is reused while the node keeps it open and for ``keepalive_s`` after its
last answer -- less than uvicorn's 5 s keep-alive. A node stopped or busy past its keep-alive still closes
one as a request goes out on it (uvloop runs the expired timer before it reads the request, and the unread
request makes the close a reset): a kept-alive connection that breaks before any byte of its answer came is
no verdict on the node, and the request goes out once more on a new connection.

In flight: ``abort_silent(base_url, since, why)`` (``orchestrate``, when the health probes take a node out of
rotation) fails every call to that node that has had no byte from it since ``since`` with ``CallAborted`` -- its
reader gets the error at once, the connection is closed (the node sees the hang-up and aborts the request once it
runs again) -- and closes the node's idle connections.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import ssl
import time
from typing import AsyncIterator, Callable
from urllib.parse import unquote, urlsplit

import httptools

_HIGH_WATER, _LOW_WATER = 256 << 10, 64 << 10     # bytes buffered: pause the socket above, resume below
_USER_AGENT = b"pdserve-proxy"


class HTTPError(Exception):
    """A node call that failed below HTTP: no usable answer came back."""


class ConnectFailed(HTTPError):
    pass


class ConnectRefused(ConnectFailed):
    """Nothing listens there: the node is gone, or draining (it stopped accepting, its open calls go on)."""


class ConnectionBroken(HTTPError):
    pass


class ReadTimeout(HTTPError):
    pass


class WriteTimeout(HTTPError):
    pass


class PoolTimeout(HTTPError):
    pass


class CallAborted(HTTPError):
    """``ConnectionPool.abort_silent`` gave up on the call: its node went silent and was taken out of rotation."""


class _Origin:
    """Where a base URL's requests go: host, port, TLS, the path prefix and the Host header."""

    def __init__(self, base_url: str, bearer: str | None = None):
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConnectFailed(f"{base_url!r} is not an http:// or https:// URL")
        self.where = base_url
        self.tls = url.scheme == "https"
        self.host, self.port = url.hostname, url.port or (443 if self.tls else 80)
        self.key = (url.scheme, self.host, self.port)
        self.prefix = url.path.rstrip("/").encode()
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = (host if url.port is None else f"{host}:{url.port}").encode("idna")
        self.extra = []                               # user:password@ -> basic auth, never the Host header
        if url.username is not None:
            user = f"{unquote(url.username)}:{unquote(url.password or '')}".encode()
            self.extra.append(b"Authorization: Basic " + base64.b64encode(user))
        elif bearer:                                  # the nodes' --api-key (--node-api-key)
            self.extra.append(b"Authorization: Bearer " + bearer.encode("latin-1"))

    def head(self, method: str, path: str, body: bytes | None, headers: tuple[bytes, ...] = ()) -> bytes:
        """``headers``: more header lines (``name: value``), e.g. the W3C ``traceparent`` (``tracing.inject``)."""
        lines = [b"%s %s%s HTTP/1.1" % (method.encode(), self.prefix, path.encode()), b"Host: " + self.host_header,
                 b"User-Agent: " + _USER_AGENT, *self.extra, *headers]
        if body is not None:
            lines += [b"Content-Type: application/json", b"Content-Length: %d" % len(body)]
        return b"\r\n".join(lines) + b"\r\n\r\n"


class _Connection(asyncio.Protocol):
    """One connection to a node and the answer now coming in on it (httptools calls the ``on_*`` methods)."""

    def __init__(self, origin: _Origin):
        self.origin, self.transport, self.closed, self.idle_since = origin, None, False, 0.0
        self.closed_here = False                      # closed by us: whatever comes after is no answer
        self._new_answer(head_only=False)

    def _new_answer(self, head_only: bool) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.headers, self.head_done, self.complete = 0, {}, False, False
        self.error: HTTPError | None = None
        self.pieces: collections.deque[bytes] = collections.deque()
        self.buffered, self.paused, self.waiter = 0, False, None
        self.in_use, self.head_only, self.begun, self.interim = False, head_only, False, False
        self.received = False                         # any byte of this answer came in
        self.active_at = time.monotonic()             # the request went out, or the latest byte came in

    # -- the caller's side
    def send(self, data: bytes, head_only: bool = False) -> None:
        """One request; ``head_only``: its answer has no body (HEAD), whatever its headers say."""
        self._new_answer(head_only)
        self.in_use = True
        self.transport.write(data)

    def abort(self, error: HTTPError) -> None:
        """Fail the call now (its waiter wakes with ``error``) and close the connection."""
        self._fail(error)
        self.close()

    async def wait(self, timeout_s: float, what: str) -> None:
        """Until the parser or the connection has news (``_wake``), at most ``timeout_s``: else ReadTimeout."""
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        timer = loop.call_later(max(timeout_s, 0.0), _expire, waiter,
                                f"{self.origin.where}: no progress within {what}")
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None

    def take(self) -> bytes | None:
        """The next piece of body read, if any."""
        if not self.pieces:
            return None
        piece = self.pieces.popleft()
        self.buffered -= len(piece)
        if self.paused and self.buffered < _LOW_WATER and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return piece

    def close(self) -> None:
        self.closed = self.closed_here = True
        if self.transport is not None:
            self.transport.close()

    # -- asyncio's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received, self.active_at = True, time.monotonic()
        if not self.in_use or self.complete:         # bytes nobody asked for: the connection is not reusable
            self._fail(ConnectionBroken(f"{self.origin.where}: the node sent bytes outside an answer"))
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if not self.complete:
                self._fail(ConnectionBroken(f"{self.origin.where}: the connection broke: the node did not answer "
                                            f"HTTP/1.1 ({type(exc).__name__}: {exc})"))
            else:                                     # bytes after the answer: it stands, the connection does not
                self._fail(ConnectionBroken(f"{self.origin.where}: the node sent bytes after its answer"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if (self.in_use and self.head_done and not self.complete and not self.closed_here and exc is None
                and self._ends_at_close()):
            self.complete = True                      # a body without length or chunking ends with the connection
        elif self.in_use and not self.complete:
            detail = f"{type(exc).__name__}: {exc}" if exc else "closed here" if self.closed_here else "closed by the node"
            self._fail(ConnectionBroken(f"{self.origin.where}: the connection broke: {detail}"))
        self._wake()

    def _ends_at_close(self) -> bool:
        return "content-length" not in self.headers and "chunked" not in self.headers.get("transfer-encoding", "")

    # -- httptools' side
    def on_message_begin(self) -> None:
        if self.begun:                                # a second answer to one request: stop parsing (feed_data
            raise ConnectionBroken("a second answer")  # raises), the connection is closed
        self.begun = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:     # 1xx (103 Early Hints...): the real answer follows
            self.headers, self.interim = {}, True
            return
        self.status, self.head_done = status, True
        if self.head_only:                            # no body follows; llhttp would wait for Content-Length
            self.complete = True                      # bytes, so this connection is not used again
            self.closed = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = self.begun = False
            return
        self.complete = True
        if not self.parser.should_keep_alive():
            self.closed = True                        # read to the end, but the node will not take another
        self._wake()

    def _fail(self, error: HTTPError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


def _expire(waiter: asyncio.Future, message: str) -> None:
    if not waiter.done():
        waiter.set_exception(ReadTimeout(message))


class Response:
    """A node's answer, its head read. ``content`` is its body once ``fetch`` or ``read`` read it."""

    def __init__(self, pool: ConnectionPool, conn: _Connection | None, status: int, headers: dict[str, str],
                 content: bytes = b""):
        self._pool, self._conn = pool, conn
        self.status, self.headers, self.content = status, headers, content

    async def read(self, deadline: float | None = None) -> bytes:
        self.content = b"".join([piece async for piece in self.iter_bytes(deadline)])
        return self.content

    async def iter_bytes(self, deadline: float | None = None) -> AsyncIterator[bytes]:
        """The body piece by piece, ``timeout_s`` for each read (or all of it by ``deadline``, a loop time);
        then the connection goes back to the pool. Any other ending closes it."""
        conn = self._conn
        if conn is None:
            raise ConnectionBroken("the answer was already read or closed")
        loop, limit = asyncio.get_running_loop(), self._pool.timeout_s
        try:
            while True:
                if self._conn is not conn:            # aclose() while this reader waited
                    raise ConnectionBroken(f"{conn.origin.where}: the answer was closed while being read")
                piece = conn.take()
                if piece is not None:
                    yield piece
                elif conn.complete:
                    break
                elif conn.error is not None:
                    raise conn.error
                else:
                    await conn.wait(limit if deadline is None else deadline - loop.time(), f"{limit:g}s")
        except BaseException:
            self._close()
            raise
        if self._conn is conn:
            self._conn = None
            self._pool._release(conn)

    async def aclose(self) -> None:
        """Done with the answer: an unread body closes the connection (the node aborts its request)."""
        self._close()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            self._pool._release(conn)


class ConnectionPool:
    """At most ``max_connections`` connections in use over all origins; idle ones kept per origin."""

    def __init__(self, max_connections: int, connect_timeout_s: float, timeout_s: float, keepalive_s: float = 4.0,
                 bearer: str | None = None):
        """``bearer``: an API key sent to every origin (``Authorization: Bearer``) whose URL names no user."""
        self.timeout_s, self.connect_timeout_s, self.keepalive_s = timeout_s, connect_timeout_s, keepalive_s
        self._bearer = bearer
        self.max_connections = max_connections
        self._slots: _Slots | None = None
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[tuple, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._tls: ssl.SSLContext | None = None

    async def fetch(self, method: str, base_url: str, path: str, body: bytes | None = None,
                    headers: tuple[bytes, ...] = ()) -> Response:
        """One request and its whole answer, within ``timeout_s``."""
        end = asyncio.get_running_loop().time() + self.timeout_s
        response = await self._request(method, base_url, path, body, end, headers)
        await response.read(end)
        return response

    async def stream(self, method: str, base_url: str, path: str, body: bytes | None = None,
                     headers: tuple[bytes, ...] = ()) -> Response:
        """One request; returns once the status line and headers are in (within ``timeout_s``)."""
        return await self._request(method, base_url, path, body, asyncio.get_running_loop().time() + self.timeout_s,
                                   headers)

    async def aclose(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._open.clear()
        self._idle.clear()

    def abort_silent(self, base_url: str, since: float, why: str) -> int:
        """Fail every call to ``base_url`` that has had no byte from it since ``since`` (``time.monotonic()``)
        with ``CallAborted`` and close its connection; close the node's idle connections. -> calls failed."""
        origin = self._origins.get(base_url)
        if origin is None:
            return 0
        for conn in self._idle.pop(origin.key, []):
            self._forget(conn)
        silent = [c for c in self._open if c.origin is origin and c.in_use and not c.complete and c.active_at < since]
        for conn in silent:
            conn.abort(CallAborted(f"{origin.where}: {why}"))
        return len(silent)

    async def _request(self, method: str, base_url: str, path: str, body: bytes | None, end: float,
                       headers: tuple[bytes, ...] = ()) -> Response:
        """Take a slot and a connection, send the request, wait for the answer's head (until ``end``)."""
        origin = self._origin(base_url)
        await self._take_slot(end)
        try:
            request = origin.head(method, path, body, headers) + (body or b"")
            head_only = method.upper() == "HEAD"
            if (conn := self._idle_connection(origin)) is not None:
                try:
                    return await self._exchange(conn, request, head_only, end)
                except ConnectionBroken:
                    if conn.received:             # the node began to answer: it did see the request
                        raise
            return await self._exchange(await self._connect(origin), request, head_only, end)
        except BaseException:
            self._slots.give()
            raise

    async def _exchange(self, conn: _Connection, request: bytes, head_only: bool, end: float) -> Response:
        """Send ``request`` on ``conn`` and wait for its answer's head; any failure closes the connection."""
        try:
            conn.send(request, head_only=head_only)
            loop = asyncio.get_running_loop()
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(end - loop.time(), f"{self.timeout_s:g}s")
        except BaseException:
            self._forget(conn)
            raise
        return Response(self, conn, conn.status, conn.headers)

    def _origin(self, base_url: str) -> _Origin:
        origin = self._origins.get(base_url)
        if origin is None:
            origin = self._origins[base_url] = _Origin(base_url, self._bearer)
        return origin

    async def _take_slot(self, end: float) -> None:
        if self._slots is None:
            self._slots = _Slots(self.max_connections)
        await self._slots.take(end, lambda: PoolTimeout(f"no free connection within {self.timeout_s:g}s "
                                                         f"(all {self.max_connections} busy)"))

    def _idle_connection(self, origin: _Origin) -> _Connection | None:
        idle, now = self._idle.get(origin.key), asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            if not conn.closed and not conn.transport.is_closing() and now - conn.idle_since < self.keepalive_s:
                return conn
            self._forget(conn)
        return None

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if origin.tls else None
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(origin), origin.host, origin.port, ssl=tls),
                self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise ConnectFailed(f"could not connect to {origin.where} within {self.connect_timeout_s:g}s") from None
        except OSError as exc:
            failed = ConnectRefused if isinstance(exc, ConnectionRefusedError) else ConnectFailed
            raise failed(f"could not connect to {origin.where}: {_describe(exc)}") from None
        self._open.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        """A connection's request is over: back to its idle list if reusable, else closed; its slot freed."""
        if conn.complete and not conn.closed and conn.error is None:
            conn.in_use, conn.idle_since = False, asyncio.get_running_loop().time()
            self._idle.setdefault(conn.origin.key, []).append(conn)
        else:
            self._forget(conn)
        self._slots.give()

    def _forget(self, conn: _Connection) -> None:
        conn.close()
        self._open.discard(conn)

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls


class _Slots:
    """At most ``n`` taken at once; waiters are served in order. A waiter cancelled in the same turn as it
    was handed a slot passes the slot on and still raises CancelledError (``asyncio.wait_for`` on 3.11 can
    return the slot and lose the cancel: a client gone would still get its node call)."""

    def __init__(self, n: int):
        self.free, self.waiters = n, collections.deque()

    async def take(self, end: float, timed_out: Callable[[], HTTPError]) -> None:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return
        loop = asyncio.get_running_loop()
        slot = loop.create_future()
        self.waiters.append(slot)
        timer = loop.call_at(end, lambda: slot.done() or slot.set_exception(timed_out()))
        try:
            await slot
        except BaseException:
            if slot.done() and not slot.cancelled() and slot.exception() is None:
                self.give()                           # handed one, then cancelled: the next waiter's
            elif slot in self.waiters:
                self.waiters.remove(slot)
            raise
        finally:
            timer.cancel()

    def give(self) -> None:
        while self.waiters:
            slot = self.waiters.popleft()
            if not slot.done():
                slot.set_result(None)
                return
        self.free += 1


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
