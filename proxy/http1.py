"""The proxy's HTTP/1.1 client for node calls: kept-alive connections, one socket write per request.

Used by ``upstream`` (one pool for requests, ``--max-node-connections``) and ``health`` (a small pool of
its own for probes):

    pool = ConnectionPool(max_connections=1024, connect_timeout_s=2.0, timeout_s=600.0)
    reply = await pool.fetch("POST", "http://127.0.0.1:8100", "/v1/completions", body_bytes)
    reply.status, reply.headers, reply.content     # headers: lower-case name -> value
    response = await pool.stream("POST", base_url, path, body_bytes)   # status and headers read
    async for piece in response.iter_bytes(): ...  # the body as it arrives; a chunked body de-chunked, the
                                                   # chunks that came in one read joined
    await response.aclose()                        # before the body's end: closes the connection -- the node
                                                   # sees the hang-up and aborts the request
    await pool.aclose()

Why not httpx: on the proxy's path it cost ~1 ms of CPU per node call against ~0.05 ms here (two calls per
client request; ``bench/proxy_overhead.py`` measures the proxy's added latency), and it writes a request's
head and body separately, which wakes the node twice.

Time limits: ``connect_timeout_s`` for a new connection; ``timeout_s`` for a free connection, for a whole
``fetch`` (write, head, body), for a ``stream``'s head and for each of its reads. Failures are ``HTTPError``s:
``ConnectFailed`` (refused, unreachable, connect timeout), ``PoolTimeout`` (every connection busy),
``WriteTimeout``, ``ReadTimeout``, ``ConnectionBroken`` (the node closed or reset the connection, or did not
answer HTTP/1.1). A connection is reused while the node keeps it open and for ``keepalive_s`` after its last
answer -- less than uvicorn's 5 s keep-alive, so the node never closes one as a request goes out on it.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
import time
from collections import deque
from contextlib import contextmanager
from typing import AsyncIterator, Iterator
from urllib.parse import urlsplit

if sys.version_info >= (3, 11):
    from asyncio import timeout as _deadline
else:                                                        # pragma: no cover - python 3.10
    from anyio import fail_after as _deadline

MAX_HEAD_BYTES = 64 << 10
_BROKEN = (OSError, EOFError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError)


class HTTPError(Exception):
    """A node call that failed below HTTP: no usable answer came back."""


class ConnectFailed(HTTPError):
    pass


class ConnectionBroken(HTTPError):
    pass


class ReadTimeout(HTTPError):
    pass


class WriteTimeout(HTTPError):
    pass


class PoolTimeout(HTTPError):
    pass


class Origin:
    """Where one base URL's requests go: scheme, host, port, path prefix, Host header."""

    def __init__(self, base_url: str):
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{base_url!r} is not an http:// or https:// URL")
        self.tls = url.scheme == "https"
        self.host, self.port = url.hostname, url.port or (443 if self.tls else 80)
        self.key = f"{url.scheme}://{self.host}:{self.port}"          # connections are shared per key
        self.prefix, self.host_header = url.path.rstrip("/"), url.netloc.rsplit("@", 1)[-1].encode("idna")

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class Connection:
    def __init__(self, origin: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.origin, self.reader, self.writer, self.idle_since = origin, reader, writer, 0.0

    @property
    def open(self) -> bool:
        return not self.reader.at_eof() and not self.writer.transport.is_closing()


class Response:
    """A node's answer, its head read. ``content`` is its body once ``fetch`` or ``read`` read it."""

    def __init__(self, pool: ConnectionPool, conn: Connection, status: int, headers: dict[str, str]):
        self._pool, self._conn, self._origin = pool, conn, conn.origin
        self.status, self.headers, self.content = status, headers, b""
        self._reusable = headers.get("connection", "").lower() != "close"

    async def read(self) -> bytes:
        self.content = b"".join([piece async for piece in self.iter_bytes()])
        return self.content

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """The body piece by piece, ``timeout_s`` for each read; then the connection goes back to the pool."""
        if self._conn is None:
            raise ConnectionBroken(f"the answer of {self._origin} was already read or closed")
        with self._failures():
            async for piece in self._body(self._conn.reader, per_read_s=self._pool.timeout_s):
                yield piece
        self._finish(self._reusable)

    async def aclose(self) -> None:
        """Done with the answer: an unread body closes the connection (the node aborts its request)."""
        self._finish(False)

    async def _body(self, reader: asyncio.StreamReader, per_read_s: float | None) -> AsyncIterator[bytes]:
        if self.status < 200 or self.status in (204, 304):
            return
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            buffer, end = bytearray(), None
            while end is None:
                buffer += await _read(reader, per_read_s)
                pieces, end = _whole_chunks(buffer)
                if pieces:
                    yield b"".join(pieces)
            self._reusable &= end == len(buffer)        # bytes after the body: the connection is not trusted again
        elif (length := self.headers.get("content-length")) is not None:
            async with _deadline(per_read_s):
                yield await reader.readexactly(int(length))
        else:                                           # the body ends when the node closes the connection
            self._reusable = False
            while piece := await _read(reader, per_read_s, eof_ok=True):
                yield piece

    @contextmanager
    def _failures(self) -> Iterator[None]:
        try:
            yield
        except (TimeoutError, asyncio.TimeoutError):
            self._finish(False)
            raise ReadTimeout(f"no data from {self._origin} within {self._pool.timeout_s:g}s") from None
        except _BROKEN as exc:
            self._finish(False)
            raise ConnectionBroken(f"the connection broke mid-answer: {_describe(exc)}") from None

    def _finish(self, reusable: bool) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._give_back(conn, reusable)


class ConnectionPool:
    """At most ``max_connections`` open connections (busy or idle) over all origins."""

    def __init__(self, max_connections: int, connect_timeout_s: float, timeout_s: float, keepalive_s: float = 4.0):
        self.timeout_s, self.connect_timeout_s, self.keepalive_s = timeout_s, connect_timeout_s, keepalive_s
        self._slots, self._waiting = asyncio.Semaphore(max_connections), 0
        self._idle: dict[str, deque[Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._busy: set[Connection] = set()

    async def fetch(self, method: str, base_url: str, path: str, body: bytes | None = None) -> Response:
        """One request and its whole answer, within ``timeout_s``."""
        origin, response = self._origin(base_url), None
        conn = await self._connection(origin)
        try:
            async with _deadline(self.timeout_s):
                response = await self._send(origin, conn, method, path, body, limit_s=None)
                with response._failures():
                    response.content = b"".join([p async for p in response._body(response._conn.reader, None)])
                response._finish(response._reusable)
                return response
        except (TimeoutError, asyncio.TimeoutError):
            if response is not None:
                response._finish(False)
            raise ReadTimeout(f"{base_url}{path} did not answer within {self.timeout_s:g}s") from None

    async def stream(self, method: str, base_url: str, path: str, body: bytes | None = None) -> Response:
        """One request; returns once the status line and headers are in (within ``timeout_s``)."""
        origin = self._origin(base_url)
        return await self._send(origin, await self._connection(origin), method, path, body, limit_s=self.timeout_s)

    async def aclose(self) -> None:
        for conn in [*self._busy, *(c for idle in self._idle.values() for c in idle)]:
            conn.writer.close()
        self._busy.clear()
        self._idle.clear()

    def _origin(self, base_url: str) -> Origin:
        return self._origins.get(base_url) or self._origins.setdefault(base_url, Origin(base_url))

    async def _send(self, origin: Origin, conn: Connection, method: str, path: str, body: bytes | None,
                    limit_s: float | None) -> Response:
        """Write the request on ``conn`` (which it owns from here on) and read the answer's head."""
        head = (f"{method} {origin.prefix}{path} HTTP/1.1\r\nhost: ".encode() + origin.host_header
                + b"\r\naccept: */*\r\nuser-agent: pdserve-proxy\r\n")
        if body is not None:
            head += b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
        waiting_on = WriteTimeout
        try:
            conn.writer.write(head + b"\r\n" + (body or b""))
            if conn.writer.transport.get_write_buffer_size():      # the kernel did not take it all at once
                async with _deadline(limit_s):
                    await conn.writer.drain()
            waiting_on = ReadTimeout
            async with _deadline(limit_s):
                status, headers = _parse_head(await conn.reader.readuntil(b"\r\n\r\n"))
        except BaseException as exc:
            self._give_back(conn, False)
            if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) and limit_s is not None:
                raise waiting_on(f"{origin}: no progress within {limit_s:g}s") from None
            if isinstance(exc, _BROKEN):
                raise ConnectionBroken(f"{origin} sent no answer: {_describe(exc)}") from None
            raise
        return Response(self, conn, status, headers)

    async def _connection(self, origin: Origin) -> Connection:
        now, idle = time.monotonic(), self._idle.get(origin.key)
        while idle:
            conn = idle.pop()                                   # the most recently used one
            if conn.open and now - conn.idle_since < self.keepalive_s:
                self._busy.add(conn)
                return conn
            self._drop(conn)
        if self._slots.locked() and (queues := [q for q in self._idle.values() if q]):
            self._drop(min(queues, key=lambda q: q[0].idle_since).popleft())    # make room: the oldest idle one
        self._waiting += 1
        try:
            async with _deadline(self.timeout_s):
                await self._slots.acquire()
        except (TimeoutError, asyncio.TimeoutError):
            raise PoolTimeout(f"no free connection within {self.timeout_s:g}s (all {len(self._busy)} busy)") from None
        finally:
            self._waiting -= 1
        try:
            conn = await self._connect(origin)
        except BaseException:
            self._slots.release()
            raise
        self._busy.add(conn)
        return conn

    async def _connect(self, origin: Origin) -> Connection:
        context = ssl.create_default_context() if origin.tls else None
        try:
            async with _deadline(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(origin.host, origin.port, ssl=context,
                                                               limit=MAX_HEAD_BYTES)
        except (TimeoutError, asyncio.TimeoutError):
            raise ConnectFailed(f"could not connect to {origin} within {self.connect_timeout_s:g}s") from None
        except OSError as exc:
            raise ConnectFailed(f"could not connect to {origin}: {_describe(exc)}") from None
        return Connection(origin, reader, writer)

    def _give_back(self, conn: Connection, reusable: bool) -> None:
        """Back to the idle list -- unless a request waits for a slot: then closed, so that it gets one."""
        self._busy.discard(conn)
        if reusable and conn.open and not self._waiting:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(conn.origin.key, deque()).append(conn)
        else:
            self._drop(conn)

    def _drop(self, conn: Connection) -> None:
        conn.writer.close()
        self._slots.release()


def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:-2]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if version == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
        headers["connection"] = "close"
    return int(rest[:3]), headers


async def _read(reader: asyncio.StreamReader, limit_s: float | None, eof_ok: bool = False) -> bytes:
    async with _deadline(limit_s):
        data = await reader.read(1 << 16)
    if not data and not eof_ok:
        raise EOFError("the node closed the connection mid-body")
    return data


def _whole_chunks(buffer: bytearray) -> tuple[list[bytes], int | None]:
    """Take the whole chunks off the front of ``buffer`` (chunked transfer coding); returns their data and,
    once the last chunk and the trailers' blank line are in, where the body ends in what is left (else None).

        buffer: <hex size>[;ext]\\r\\n <size bytes> \\r\\n ... 0\\r\\n [trailer lines\\r\\n] \\r\\n
    """
    pieces = []
    while (line_end := buffer.find(b"\r\n")) >= 0:
        size = int(bytes(buffer[:line_end]).split(b";", 1)[0], 16)
        if size == 0:
            trailers_end = buffer.find(b"\r\n\r\n", line_end)
            return pieces, None if trailers_end < 0 else trailers_end + 4
        if len(buffer) < line_end + size + 4:
            break
        if buffer[line_end + 2 + size:line_end + 4 + size] != b"\r\n":
            raise ValueError("a chunk does not end in CRLF")
        pieces.append(bytes(buffer[line_end + 2:line_end + 2 + size]))
        del buffer[:line_end + 4 + size]
    return pieces, None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the node closed the connection"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
