"""Limits a request meets before any work is done for it, shared by the node and the proxy.

    limits = RequestLimits(max_request_bytes=8 << 20, tokenize_timeout_s=10)   # engine.request_limits
    app.add_middleware(BodyLimits, limits=limits)     # node: engine.server.app; proxy: proxy.app

``BodyLimits`` is pure ASGI and sits in front of FastAPI's body parsing: a declared ``Content-Length``
over ``--max-request-bytes`` is answered 413 before a byte is read, a body that grows past it while
being read is answered 413 at that point, and a JSON body nested deeper than ``max_json_depth`` is
answered 400 before ``json.loads`` (whose recursion would otherwise end in a 500) ever sees it. The
body it read is handed on to the app unchanged. Prompt-level limits (characters, tokenization time)
live in ``prompt_work``.
"""

from __future__ import annotations

import anyio
import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.engine.request_limits import RequestLimits
from pdserve.engine.server.errors import error_response

__all__ = ["BodyLimits", "RequestLimits", "json_depth"]

_OPEN, _CLOSE = (0x5B, 0x7B), (0x5D, 0x7D)     # [ {   ] }
_QUOTE, _BACKSLASH = 0x22, 0x5C
_SCAN_IN_THREAD_BYTES = 256 << 10              # bigger bodies are scanned off the event loop


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class BodyLimits:
    """Pure ASGI middleware: size and nesting of request bodies, checked before the app parses them."""

    def __init__(self, app: ASGIApp, limits: RequestLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        try:
            self._check_declared(scope)
            body = await self._read(receive)
            await self._check_depth(body)
        except _Refused as exc:
            await error_response(exc.status, exc.message, code="request_too_large" if exc.status == 413 else None)(
                scope, receive, send)
            return
        await self.app(scope, replay_body(body, receive), send)

    def _check_declared(self, scope: Scope) -> None:
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.limits.max_request_bytes:
            raise _Refused(413, f"request body has {int(declared)} bytes; --max-request-bytes is "
                                f"{self.limits.max_request_bytes}")

    async def _read(self, receive: Receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Refused(499, "client disconnected while sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_request_bytes:
                raise _Refused(413, f"request body has more than {self.limits.max_request_bytes} bytes; "
                                    f"--max-request-bytes is {self.limits.max_request_bytes}")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _check_depth(self, body: bytes) -> None:
        limit = self.limits.max_json_depth
        if body.count(b"[") + body.count(b"{") <= limit:        # cannot nest deeper: skip the scan
            return
        if len(body) > _SCAN_IN_THREAD_BYTES:
            depth = await anyio.to_thread.run_sync(json_depth, body)
        else:
            depth = json_depth(body)
        if depth > limit:
            raise _Refused(400, f"request body nests JSON {depth} levels deep; the limit is {limit}")


def replay_body(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the client's own messages (a later disconnect still arrives)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def json_depth(body: bytes) -> int:
    """How deep ``[`` and ``{`` nest in JSON text, brackets inside strings not counted (vectorised: an
    8 MiB body takes milliseconds). Malformed JSON gives some number; the parser rejects it later."""
    a = np.frombuffer(body, dtype=np.uint8)
    brackets = np.flatnonzero(np.isin(a, _OPEN + _CLOSE))
    if not len(brackets):
        return 0
    quotes = np.flatnonzero(a == _QUOTE)
    quotes = quotes[~_escaped(a, quotes)]
    structural = brackets[np.searchsorted(quotes, brackets) % 2 == 0]     # an even number of quotes before
    step = np.where(np.isin(a[structural], _OPEN), 1, -1).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


def _escaped(a: np.ndarray, quotes: np.ndarray) -> np.ndarray:
    """For each quote position: is it right after an odd run of backslashes (``\\"`` inside a string)?"""
    backslashes = np.flatnonzero(a == _BACKSLASH)
    if not len(quotes) or not len(backslashes):
        return np.zeros(len(quotes), dtype=bool)
    breaks = np.flatnonzero(np.diff(backslashes) != 1)          # runs of consecutive backslashes
    starts = backslashes[np.r_[0, breaks + 1]]
    ends = backslashes[np.r_[breaks, len(backslashes) - 1]]
    run = np.minimum(np.searchsorted(ends, quotes - 1), len(ends) - 1)
    return (ends[run] == quotes - 1) & ((ends[run] - starts[run]) % 2 == 0)
