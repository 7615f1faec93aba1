"""One HTTP call to one node, with its failure sorted into "try another node" or "tell the client".

Called by ``orchestrate`` inside a ``NodePool.lease``:

    payload = await post_json(client, node, path, body)          # a whole JSON answer
    stream  = await open_stream(client, node, path, body)        # 200 and its first SSE event read
    async for event in stream.events(): ...                      # then the rest, event by event
    await stream.aclose()                                        # closing makes the node abort

``NodeFailed``: the node is unreachable, died, or answered 5xx -- retriable elsewhere while no
byte has gone to the client (``unreachable`` says whether to take it out of rotation).
``NodeRejected``: the node answered 4xx -- the request itself is bad; passed to the client as is.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

import httpx

from pdserve.proxy.nodes import Node

_KEEP_IN_ROTATION = (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout)


class NodeFailed(Exception):
    def __init__(self, node: Node, message: str, unreachable: bool):
        super().__init__(f"{node.role} node {node.url}: {message}")
        self.node, self.unreachable = node, unreachable


class NodeRejected(Exception):
    def __init__(self, status: int, content: bytes):
        super().__init__(f"node answered {status}")
        self.status, self.content = status, content


async def post_json(client: httpx.AsyncClient, node: Node, path: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        response = await client.post(node.url + path, json=body)
    except httpx.TransportError as exc:
        raise _transport_failure(node, exc) from exc
    _check_status(node, response.status_code, response.content)
    try:
        payload = response.json()
    except ValueError as exc:
        raise NodeFailed(node, f"answered 200 with a body that is not JSON: {exc}", unreachable=False) from None
    if not isinstance(payload, dict):
        raise NodeFailed(node, f"answered 200 with JSON {type(payload).__name__}, not an object", unreachable=False)
    return payload


class NodeStream:
    """An open SSE response whose first event has been read (so the node did start answering)."""

    def __init__(self, node: Node, response: httpx.Response, events: AsyncIterator[bytes], first: bytes):
        self.node, self._response, self._events, self.first = node, response, events, first
        self.on_close: Callable[[], None] = lambda: None     # set by the caller: release its lease

    async def events(self) -> AsyncIterator[bytes]:
        yield self.first
        async for event in self._events:
            yield event

    async def aclose(self) -> None:
        try:
            await self._response.aclose()
        finally:
            self.on_close()
            self.on_close = lambda: None


async def open_stream(client: httpx.AsyncClient, node: Node, path: str, body: dict[str, Any]) -> NodeStream:
    request = client.build_request("POST", node.url + path, json=body)
    try:
        response = await client.send(request, stream=True)
    except httpx.TransportError as exc:
        raise _transport_failure(node, exc) from exc
    try:
        if response.status_code != 200:
            _check_status(node, response.status_code, await response.aread())
        events = sse_events(response.aiter_bytes())
        first = await anext(events, None)
        if first is None:
            raise NodeFailed(node, "closed the stream before its first event", unreachable=False)
        return NodeStream(node, response, events, first)
    except httpx.TransportError as exc:
        await response.aclose()
        raise _transport_failure(node, exc) from exc
    except BaseException:
        await response.aclose()
        raise


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Re-cut a byte stream into whole SSE events (each ending in a blank line)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while (end := buffer.find(b"\n\n")) >= 0:
            yield buffer[:end + 2]
            buffer = buffer[end + 2:]
    if buffer.strip():
        yield buffer if buffer.endswith(b"\n\n") else buffer.rstrip(b"\n") + b"\n\n"


def _check_status(node: Node, status: int, content: bytes) -> None:
    if status >= 500:
        raise NodeFailed(node, f"answered {status}: {content[:300].decode(errors='replace')}", unreachable=False)
    if status >= 400:
        raise NodeRejected(status, content)
    if status != 200:
        raise NodeFailed(node, f"answered unexpected status {status}", unreachable=False)


def _transport_failure(node: Node, exc: httpx.TransportError) -> NodeFailed:
    unreachable = not isinstance(exc, _KEEP_IN_ROTATION)
    return NodeFailed(node, f"{type(exc).__name__}: {exc or 'no detail'}", unreachable=unreachable)
