"""The proxy's HTTP/1.1 client for node calls: kept-alive connections, on aiohttp.

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

Why aiohttp and not httpx: on the proxy's path httpx cost ~0.76 ms of CPU per node call against ~0.21 ms
for aiohttp (two calls per client request; ``bench/proxy_overhead.py`` measures the proxy's added latency).
One ``aiohttp.ClientSession`` per pool, created on first use inside the running loop.

Time limits: ``connect_timeout_s`` for a new connection; ``timeout_s`` for a free connection, for a whole
``fetch`` (free connection, write, head, body), for a ``stream``'s head and for each of its reads. Failures
are ``HTTPError``s: ``ConnectFailed`` (refused, unreachable, connect timeout), ``PoolTimeout`` (every
connection busy), ``ReadTimeout`` (no progress: aiohttp does not tell a stalled write from a silent node, so
``WriteTimeout`` is kept for callers but not raised), ``ConnectionBroken`` (the node closed or reset the
connection, or did not answer HTTP/1.1). A connection is reused while the node keeps it open and for
``keepalive_s`` after its last answer -- less than uvicorn's 5 s keep-alive, so the node never closes one as a
request goes out on it.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from types import SimpleNamespace
from typing import AsyncIterator, Iterator

import aiohttp

_JSON = {"content-type": "application/json"}


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


class Response:
    """A node's answer, its head read. ``content`` is its body once ``fetch`` or ``read`` read it."""

    def __init__(self, pool: ConnectionPool, raw: aiohttp.ClientResponse | None, status: int,
                 headers: dict[str, str], content: bytes = b""):
        self._pool, self._raw = pool, raw
        self.status, self.headers, self.content = status, headers, content

    async def read(self) -> bytes:
        self.content = b"".join([piece async for piece in self.iter_bytes()])
        return self.content

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """The body piece by piece, ``timeout_s`` for each read; then the connection goes back to the pool."""
        raw = self._raw
        if raw is None:
            raise ConnectionBroken("the answer was already read or closed")
        with self._pool._failures(f"{raw.url.host}:{raw.url.port}", on_error=self._close):
            async for piece in raw.content.iter_any():
                yield piece
        self._raw = None
        raw.release()

    async def aclose(self) -> None:
        """Done with the answer: an unread body closes the connection (the node aborts its request)."""
        self._close()

    def _close(self) -> None:
        raw, self._raw = self._raw, None
        if raw is not None:
            raw.close()


class ConnectionPool:
    """At most ``max_connections`` connections in use over all origins (aiohttp's ``TCPConnector(limit=)``)."""

    def __init__(self, max_connections: int, connect_timeout_s: float, timeout_s: float, keepalive_s: float = 4.0):
        self.timeout_s, self.connect_timeout_s, self.keepalive_s = timeout_s, connect_timeout_s, keepalive_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def fetch(self, method: str, base_url: str, path: str, body: bytes | None = None) -> Response:
        """One request and its whole answer, within ``timeout_s``."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, connect=self.timeout_s,
                                        sock_connect=self.connect_timeout_s)
        waiting = SimpleNamespace(queued=False)
        with self._failures(base_url, waiting=waiting):
            async with self._request(method, base_url, path, body, timeout, waiting) as raw:
                content = await raw.read()
        return Response(self, None, raw.status, _lower(raw), content)

    async def stream(self, method: str, base_url: str, path: str, body: bytes | None = None) -> Response:
        """One request; returns once the status line and headers are in (within ``timeout_s``)."""
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout_s, sock_connect=self.connect_timeout_s,
                                        sock_read=self.timeout_s)
        waiting = SimpleNamespace(queued=False)
        with self._failures(base_url, waiting=waiting):
            raw = await self._request(method, base_url, path, body, timeout, waiting)
        return Response(self, raw, raw.status, _lower(raw))

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _request(self, method: str, base_url: str, path: str, body: bytes | None, timeout: aiohttp.ClientTimeout,
                 waiting: SimpleNamespace):
        return self._client().request(method, base_url.rstrip("/") + path, data=body,
                                      headers=_JSON if body is not None else None, timeout=timeout,
                                      allow_redirects=False, trace_request_ctx=waiting)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=self.keepalive_s)
            self._session = aiohttp.ClientSession(
                connector=connector, trace_configs=[_queue_trace()], auto_decompress=False,
                headers={"user-agent": "pdserve-proxy"}, skip_auto_headers=("accept-encoding",))
        return self._session

    @contextmanager
    def _failures(self, where: str, waiting: SimpleNamespace | None = None, on_error=lambda: None) -> Iterator[None]:
        """aiohttp's and asyncio's failures as this module's kinds (which decide retry and rotation)."""
        try:
            yield
        except (asyncio.TimeoutError, TimeoutError) as exc:
            on_error()
            if waiting is not None and waiting.queued:
                raise PoolTimeout(f"no free connection within {self.timeout_s:g}s "
                                  f"(all {self.max_connections} busy)") from None
            if isinstance(exc, aiohttp.ConnectionTimeoutError):
                raise ConnectFailed(f"could not connect to {where} within {self.connect_timeout_s:g}s") from None
            raise ReadTimeout(f"{where}: no progress within {self.timeout_s:g}s") from None
        except aiohttp.ClientConnectorError as exc:
            raise ConnectFailed(f"could not connect to {where}: {_describe(exc)}") from None
        except aiohttp.InvalidURL:
            raise
        except (aiohttp.ClientError, OSError, EOFError) as exc:
            on_error()
            raise ConnectionBroken(f"{where}: the connection broke: {_describe(exc)}") from None


def _queue_trace() -> aiohttp.TraceConfig:
    """Marks a request that waits for a free connection, so that its timeout is a ``PoolTimeout``."""
    async def queued(session, context, params, flag=True) -> None:
        context.trace_request_ctx.queued = flag

    async def dequeued(session, context, params) -> None:
        await queued(session, context, params, flag=False)

    trace = aiohttp.TraceConfig()
    trace.on_connection_queued_start.append(queued)
    trace.on_connection_queued_end.append(dequeued)
    return trace


def _lower(raw: aiohttp.ClientResponse) -> dict[str, str]:
    return {name.lower(): value for name, value in raw.headers.items()}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
