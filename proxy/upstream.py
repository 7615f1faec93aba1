"""One HTTP call to one node, with its failure sorted into "try another node" or "tell the client".

Called by ``orchestrate`` inside a ``NodePool.lease``:

    payload, raw = await post_json(client, node, path, body)     # a whole JSON answer, parsed and as sent
    stream  = await open_stream(client, node, path, body)        # 200 and its events up to the first token
    async for batch in stream.batches(): ...                     # then all of them, the events that arrived
                                                                 # together in one batch
    await stream.aclose()                                        # closing makes the node abort

``NodeFailed``: the node is unreachable, died, answered 5xx, or streamed a server error before its first
token -- retriable elsewhere while no byte has gone to the client (``unreachable`` says whether to take
it out of rotation; a pool or read timeout does not; ``down``: the probes took the node out of rotation
while the call waited on it, ``http1.CallAborted``). ``NodeBusy`` (a ``NodeFailed``): the node answered
429 or 503, i.e. it is full for now (its ``Retry-After`` is kept) -- tried elsewhere, and passed to the
client as is only when every node was busy. ``NodeRejected``: any other 4xx -- the request itself is
bad; passed to the client as is.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable

from pdserve.proxy.http1 import (CallAborted, ConnectionPool, HTTPError, PoolTimeout, ReadTimeout, Response,
                                 WriteTimeout)
from pdserve.proxy.nodes import Node

_KEEP_IN_ROTATION = (ReadTimeout, WriteTimeout, PoolTimeout)
_BUSY = (429, 503)


class NodeFailed(Exception):
    def __init__(self, node: Node, message: str, unreachable: bool, down: bool = False):
        super().__init__(f"{node.role} node {node.url}: {message}")
        self.node, self.unreachable, self.down = node, unreachable, down


class NodeBusy(NodeFailed):
    def __init__(self, node: Node, status: int, content: bytes, retry_after: str | None):
        super().__init__(node, f"answered {status} (busy; Retry-After {retry_after})", unreachable=False)
        self.status, self.content, self.retry_after = status, content, retry_after


class NodeRejected(Exception):
    def __init__(self, status: int, content: bytes):
        super().__init__(f"node answered {status}")
        self.status, self.content = status, content


async def post_json(client: ConnectionPool, node: Node, path: str, body: dict[str, Any],
                    headers: tuple[bytes, ...] = ()) -> tuple[dict[str, Any], bytes]:
    """The node's 200 answer, parsed and as sent (so that it can be passed on without encoding it again).
    ``headers``: more request header lines (the trace context, ``tracing.inject``)."""
    try:
        response = await client.fetch("POST", node.url, path, encode_json(body), headers)
    except HTTPError as exc:
        raise _transport_failure(node, exc) from exc
    content = response.content
    _check_status(node, response, content)
    try:
        payload = json.loads(content)
    except ValueError as exc:
        raise NodeFailed(node, f"answered 200 with a body that is not JSON: {exc}", unreachable=False) from None
    if not isinstance(payload, dict):
        raise NodeFailed(node, f"answered 200 with JSON {type(payload).__name__}, not an object", unreachable=False)
    return payload, content


def encode_json(body: dict[str, Any]) -> bytes:
    """A request body as httpx's ``json=`` wrote it: compact, UTF-8, no NaN. Never fails on a client's body
    that the request models passed (their strings are Unicode text, free-form numbers finite: ``text``)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class NodeStream:
    """An open SSE response whose events up to the first token (or the end) have been read, so the node
    did start answering: ``head`` holds them (a chat stream's role chunks come before its first token),
    ``rest`` the events that arrived with the head's last one."""

    def __init__(self, node: Node, response: Response, batches: AsyncIterator[list[bytes]], head: list[bytes],
                 rest: list[bytes]):
        self.node, self._response, self._batches, self.head, self._rest = node, response, batches, head, rest
        self.on_close: Callable[[], None] = lambda: None     # set by the caller: release its lease

    async def batches(self) -> AsyncIterator[list[bytes]]:
        """All the events, head first, in batches: those that arrived together go on together."""
        yield self.head + self._rest
        async for batch in self._batches:
            yield batch

    async def aclose(self) -> None:
        try:
            await self._response.aclose()
        finally:
            self.on_close()
            self.on_close = lambda: None


async def open_stream(client: ConnectionPool, node: Node, path: str, body: dict[str, Any],
                      headers: tuple[bytes, ...] = ()) -> NodeStream:
    try:
        response = await client.stream("POST", node.url, path, encode_json(body), headers)
    except HTTPError as exc:
        raise _transport_failure(node, exc) from exc
    try:
        if response.status != 200:
            _check_status(node, response, await response.read())
        batches = sse_batches(response.iter_bytes())
        return NodeStream(node, response, batches, *await _head(node, batches))
    except HTTPError as exc:
        await response.aclose()
        raise _transport_failure(node, exc) from exc
    except BaseException:
        await response.aclose()
        raise


async def _head(node: Node, batches: AsyncIterator[list[bytes]]) -> tuple[list[bytes], list[bytes]]:
    """Events up to and including the first that is not a preamble, and the rest of its batch; a server error
    before it is the node's failure (HTTP 200 was only a promise), a client error (invalid_request_error) is
    passed on."""
    head = []
    async for batch in batches:
        for i, event in enumerate(batch):
            head.append(event)
            kind, message = _kind(event)
            if kind == "server_error":
                raise NodeFailed(node, f"streamed an error before its first token: {message}", unreachable=False)
            if kind != "preamble":
                return head, batch[i + 1:]
    if not head:
        raise NodeFailed(node, "closed the stream before its first event", unreachable=False)
    return head, []


def _kind(event: bytes) -> tuple[str, str]:
    """("preamble" | "server_error" | "output", error message): a preamble is a chunk without output
    (the role chunk of a chat stream); anything unreadable counts as output and is passed on."""
    data = event.strip().removeprefix(b"data:").strip()
    try:
        payload = json.loads(data)
    except ValueError:
        return "output", ""
    if not isinstance(payload, dict):
        return "output", ""
    if isinstance(error := payload.get("error"), dict):
        kind = "output" if error.get("type") == "invalid_request_error" else "server_error"
        return kind, str(error.get("message", ""))[:300]
    choices = payload.get("choices")
    if isinstance(choices, list) and choices and all(_is_preamble(c) for c in choices):
        return "preamble", ""
    return "output", ""


def _is_preamble(choice: Any) -> bool:
    if not isinstance(choice, dict) or choice.get("finish_reason") or choice.get("text") or choice.get("logprobs"):
        return False
    delta = choice.get("delta")
    return isinstance(delta, dict) and not delta.get("content") and "text" not in choice


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Re-cut a byte stream into whole SSE events (each ending in a blank line)."""
    async for batch in sse_batches(chunks):
        for event in batch:
            yield event


async def sse_batches(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """``sse_events`` in batches: the whole events each piece of the byte stream completed."""
    buffer = b""
    async for chunk in chunks:
        buffer, batch = buffer + chunk, []
        while (end := buffer.find(b"\n\n")) >= 0:
            batch.append(buffer[:end + 2])
            buffer = buffer[end + 2:]
        if batch:
            yield batch
    if buffer.strip():
        yield [buffer if buffer.endswith(b"\n\n") else buffer.rstrip(b"\n") + b"\n\n"]


def _check_status(node: Node, response: Response, content: bytes) -> None:
    status = response.status
    if status in _BUSY:
        raise NodeBusy(node, status, content, response.headers.get("retry-after"))
    if status >= 500:
        raise NodeFailed(node, f"answered {status}: {content[:300].decode(errors='replace')}", unreachable=False)
    if status >= 400:
        raise NodeRejected(status, content)
    if status != 200:
        raise NodeFailed(node, f"answered unexpected status {status}", unreachable=False)


def _transport_failure(node: Node, exc: HTTPError) -> NodeFailed:
    unreachable = not isinstance(exc, _KEEP_IN_ROTATION)
    return NodeFailed(node, f"{type(exc).__name__}: {exc or 'no detail'}", unreachable=unreachable,
                      down=isinstance(exc, CallAborted))
