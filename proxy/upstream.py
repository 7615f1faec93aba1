"""One HTTP call to one node, with its failure sorted into "try another node" or "tell the client".

Called by ``orchestrate`` inside a ``NodePool.lease``:

    payload = await post_json(client, node, path, body)          # a whole JSON answer
    stream  = await open_stream(client, node, path, body)        # 200 and its events up to the first token
    async for event in stream.events(): ...                      # then the rest, event by event
    await stream.aclose()                                        # closing makes the node abort

``NodeFailed``: the node is unreachable, died, answered 5xx, or streamed a server error before its first
token -- retriable elsewhere while no byte has gone to the client (``unreachable`` says whether to take
it out of rotation; a pool or read timeout does not). ``NodeBusy`` (a ``NodeFailed``): the node answered
429 or 503, i.e. it is full for now (its ``Retry-After`` is kept) -- tried elsewhere, and passed to the
client as is only when every node was busy. ``NodeRejected``: any other 4xx -- the request itself is
bad; passed to the client as is.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable

import httpx

from pdserve.proxy.nodes import Node

_KEEP_IN_ROTATION = (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout)
_BUSY = (429, 503)


class NodeFailed(Exception):
    def __init__(self, node: Node, message: str, unreachable: bool):
        super().__init__(f"{node.role} node {node.url}: {message}")
        self.node, self.unreachable = node, unreachable


class NodeBusy(NodeFailed):
    def __init__(self, node: Node, status: int, content: bytes, retry_after: str | None):
        super().__init__(node, f"answered {status} (busy; Retry-After {retry_after})", unreachable=False)
        self.status, self.content, self.retry_after = status, content, retry_after


class NodeRejected(Exception):
    def __init__(self, status: int, content: bytes):
        super().__init__(f"node answered {status}")
        self.status, self.content = status, content


async def post_json(client: httpx.AsyncClient, node: Node, path: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        response = await client.post(node.url + path, json=body)
    except httpx.TransportError as exc:
        raise _transport_failure(node, exc) from exc
    _check_status(node, response, response.content)
    try:
        payload = response.json()
    except ValueError as exc:
        raise NodeFailed(node, f"answered 200 with a body that is not JSON: {exc}", unreachable=False) from None
    if not isinstance(payload, dict):
        raise NodeFailed(node, f"answered 200 with JSON {type(payload).__name__}, not an object", unreachable=False)
    return payload


class NodeStream:
    """An open SSE response whose events up to the first token (or the end) have been read, so the node
    did start answering: ``head`` holds them (a chat stream's role chunks come before its first token)."""

    def __init__(self, node: Node, response: httpx.Response, events: AsyncIterator[bytes], head: list[bytes]):
        self.node, self._response, self._events, self.head = node, response, events, head
        self.on_close: Callable[[], None] = lambda: None     # set by the caller: release its lease

    async def events(self) -> AsyncIterator[bytes]:
        for event in self.head:
            yield event
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
            _check_status(node, response, await response.aread())
        events = sse_events(response.aiter_bytes())
        return NodeStream(node, response, events, await _head(node, events))
    except httpx.TransportError as exc:
        await response.aclose()
        raise _transport_failure(node, exc) from exc
    except BaseException:
        await response.aclose()
        raise


async def _head(node: Node, events: AsyncIterator[bytes]) -> list[bytes]:
    """Events up to and including the first that is not a preamble; a server error before it is the
    node's failure (HTTP 200 was only a promise), a client error (invalid_request_error) is passed on."""
    head = []
    async for event in events:
        head.append(event)
        kind, message = _kind(event)
        if kind == "server_error":
            raise NodeFailed(node, f"streamed an error before its first token: {message}", unreachable=False)
        if kind != "preamble":
            return head
    if not head:
        raise NodeFailed(node, "closed the stream before its first event", unreachable=False)
    return head


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
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while (end := buffer.find(b"\n\n")) >= 0:
            yield buffer[:end + 2]
            buffer = buffer[end + 2:]
    if buffer.strip():
        yield buffer if buffer.endswith(b"\n\n") else buffer.rstrip(b"\n") + b"\n\n"


def _check_status(node: Node, response: httpx.Response, content: bytes) -> None:
    status = response.status_code
    if status in _BUSY:
        raise NodeBusy(node, status, content, response.headers.get("retry-after"))
    if status >= 500:
        raise NodeFailed(node, f"answered {status}: {content[:300].decode(errors='replace')}", unreachable=False)
    if status >= 400:
        raise NodeRejected(status, content)
    if status != 200:
        raise NodeFailed(node, f"answered unexpected status {status}", unreachable=False)


def _transport_failure(node: Node, exc: httpx.TransportError) -> NodeFailed:
    unreachable = not isinstance(exc, _KEEP_IN_ROTATION)
    return NodeFailed(node, f"{type(exc).__name__}: {exc or 'no detail'}", unreachable=unreachable)
