"""The P->D flow of one client request: prefill on one node, then decode on another.

Called by ``app`` once the request is parsed (``inputs.parse_request``):

    response = await orchestrator.handle(req, on_end)    # JSONResponse or StreamingResponse

0. Routing by cache (``kv_routing``): the store lookup, the nodes' KV events and the P/D decision. "store_hit" and
   "decode_local" skip step 1: the decode node gets the prompt without ``kv_transfer_params``. The decision is
   counted (``pdserve_proxy_pd_decisions``) and, with ``--expose-kv-accounting``, is ``usage.kv_transfer.route``.

1. Prefill: ``prefill_body`` (max_tokens=1, stream=false, prompt_token_ids, do_remote_decode)
   goes to a prefill node, one call per prompt (a completions prompt list: concurrently, each
   routed by its own prefix); each answer's top-level ``kv_transfer_params`` (opaque here; null
   when the node has none, e.g. a ``--role both`` node) is kept. A non-streaming request for one
   token and one prompt is answered from this response (``kv_transfer_params`` removed).
2. Decode: ``decode_body`` (the client's body + prompt_token_ids + kv_transfer_params, lists of
   both for several prompts) goes to one decode node; its answer -- JSON, or the SSE events one
   by one -- is passed through as is. The decode node emits each prompt's first token itself
   (with the logprobs the prefill node computed), so no token is dropped or generated twice.

Unless ``expose_kv_accounting`` (``--expose-kv-accounting``), ``usage.kv_transfer`` is taken out of every
answer on its way to the client (``accounting``); everything else passes unchanged.

Each phase tries up to ``max_attempts`` nodes while nothing has reached the client: a node that
is unreachable, answers 5xx, or streams a server error before its first token is skipped (and, if
unreachable, taken out of rotation); one that answers 429 or 503 is busy: skipped too, and its
answer (with ``Retry-After``) reaches the client only if the last node tried was busy as well; any
other 4xx is the client's fault and returned unchanged. A stream that breaks later -- the node's connection
reset or closed before ``[DONE]``, or anything else that goes wrong while relaying -- ends with an SSE error
event and ``[DONE]``, never with a cut connection. Closing a stream (client gone, cancellation) closes the
node's response, which makes the node abort the request and free its blocks.

No request outlives its node's health: when a probe takes a node out of rotation, ``health`` calls
``abort_calls``, which fails the calls in flight on that node that have heard nothing from it since the probe
went out (``ConnectionPool.abort_silent``). Such a call is tried on another healthy node of its role while
nothing reached the client (a prefill call; a decode call before its stream's first byte); with none left the
client gets 503 with ``Retry-After`` (as when no node was healthy to begin with); a stream under way ends with
the error event above.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.engine import tracing
from pdserve.engine.server.errors import error_body, error_response
from pdserve.proxy.accounting import (drop_kv_accounting, event_with_route, event_without_kv_accounting,
                                      json_with_route, json_without_kv_accounting, set_route)
from pdserve.proxy.http1 import ConnectionBroken, ConnectionPool, HTTPError
from pdserve.proxy.inputs import ProxyRequest, decode_body, prefill_body
from pdserve.proxy.kv_routing import KVRouting, Route
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.nodes import Node
from pdserve.proxy.policies import KVHint
from pdserve.proxy.router import NoHealthyNode, NodePool
from pdserve.proxy.upstream import NodeBusy, NodeFailed, NodeRejected, NodeStream, open_stream, post_json

logger = logging.getLogger(__name__)
T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
OnEnd = Callable[[str], None]          # called once with the request's outcome label


class Orchestrator:
    def __init__(self, client: ConnectionPool, prefill: NodePool, decode: NodePool, metrics: ProxyMetrics,
                 max_attempts: int, model_name: Callable[[], str | None], retry_after_s: int = 1,
                 expose_kv_accounting: bool = True, kv: KVRouting | None = None):
        self._client, self._prefill, self._decode, self._kv = client, prefill, decode, kv
        self._metrics, self._max_attempts, self._model_name = metrics, max_attempts, model_name
        self._retry_after = str(retry_after_s)      # a 503 for want of a healthy node: the next probe round
        self._expose = expose_kv_accounting

    def abort_calls(self, node: Node, silent_since: float, why: str) -> None:
        """``node`` was taken out of rotation: fail its calls that heard nothing from it since ``silent_since``."""
        count = self._client.abort_silent(node.url, silent_since, f"{node.role} node taken out of rotation ({why})")
        if count:
            logger.warning("%s node %s out of rotation: failed %d call(s) waiting on it", node.role, node.url, count)
            self._metrics.aborted_calls.labels(node.role).inc(count)

    async def handle(self, req: ProxyRequest, on_end: OnEnd) -> Response:
        try:
            return await self._handle(req, on_end)
        except NodeRejected as exc:
            on_end("client_error")
            return Response(exc.content, status_code=exc.status, media_type="application/json")
        except NodeBusy as exc:                  # every node tried was full: the last one's answer
            on_end("busy")
            headers = {"Retry-After": exc.retry_after} if exc.retry_after else None
            return Response(exc.content, status_code=exc.status, media_type="application/json", headers=headers)
        except NoHealthyNode as exc:
            on_end("no_node")
            return error_response(503, str(exc), headers={"Retry-After": self._retry_after})
        except NodeFailed as exc:
            on_end("upstream_error")
            return error_response(502, f"{exc} (after retries on other nodes)")

    async def _handle(self, req: ProxyRequest, on_end: OnEnd) -> Response:
        route = await self._kv.plan(req, lambda: self._decode.healthy, self._decode.picks_by_cache) \
            if self._kv is not None and self._kv.active else None
        decision = route.decision if route is not None else "prefill"
        self._metrics.pd_decisions.labels(decision).inc()
        shown = route.describe() if route is not None and self._expose else None
        if decision == "prefill":
            prefilled = await self.prefill(req, route)
            if req.prefill_only:
                prefilled[0].pop("kv_transfer_params", None)
                if not self._expose:
                    drop_kv_accounting(prefilled[0])
                elif shown is not None:
                    set_route(prefilled[0], shown)
                on_end("ok")
                return JSONResponse(prefilled[0])
            kv = [p.get("kv_transfer_params") for p in prefilled]
        else:                      # the decode node looks the prompt up in the store and computes the rest itself
            kv = [None] * len(req.prompts)
        hint = route.hint() if route is not None else None
        skipped = _Skip(self, req, route) if decision != "prefill" else None
        if not req.stream:
            content = await _unwrapped(self._retrying(
                self._decode, req.chunk_keys, lambda node: self._decode_json(node, req, kv, skipped), hint))
            shown = skipped.shown(shown) if skipped is not None else shown
            on_end("ok")
            if not self._expose:
                content = json_without_kv_accounting(content)
            elif shown is not None:
                content = json_with_route(content, shown)
            return Response(content, media_type="application/json")      # the node's JSON, as it sent it
        stream = await _unwrapped(self._retrying(
            self._decode, req.chunk_keys, lambda node: self._decode_stream(node, req, kv, skipped), hint))
        shown = skipped.shown(shown) if skipped is not None else shown
        redact = event_without_kv_accounting if not self._expose else \
            (event_with_route(shown) if shown is not None else None)
        return RelayResponse(stream, on_end, redact)

    async def prefill(self, req: ProxyRequest, route: Route | None = None) -> list[dict[str, Any]]:
        """One prefill answer per prompt, in prompt order (a "prefill" span around them, tracing on)."""
        start = time.perf_counter()
        span = tracing.start_span("prefill", "client") if tracing.enabled() else None
        try:
            with tracing.use(span):
                payloads = await _all_or_cancel([self._prefill_one(req, i, route.hint(i) if route else None)
                                                 for i in range(len(req.prompts))])
        finally:                               # a failed prefill's time counts too, as a failed decode's does
            tracing.end(span)
            self._metrics.phase_latency.labels("prefill").observe(time.perf_counter() - start)
        return payloads

    async def _prefill_one(self, req: ProxyRequest, index: int, hint: KVHint | None) -> dict[str, Any]:
        body, prompt = prefill_body(req, self._model_name(), index), req.prompts[index]

        async def call(node: Node) -> dict[str, Any]:
            with self._prefill.lease(node, len(prompt.ids)):
                return (await post_json(self._client, node, req.endpoint, body, tracing.inject()))[0]

        return await self._retrying(self._prefill, prompt.chunk_keys, call, hint)

    async def _decode_json(self, node: Node, req: ProxyRequest, kv: list[Any], skipped: _Skip | None) -> bytes:
        kv = await skipped.kv_for(node) if skipped is not None else kv
        start = time.perf_counter()
        span = tracing.start_span("decode", "client") if tracing.enabled() else None
        try:
            with self._decode.lease(node, req.decode_tokens), tracing.use(span):
                body = decode_body(req, self._model_name(), kv)
                return (await post_json(self._client, node, req.endpoint, body, tracing.inject()))[1]
        finally:
            tracing.end(span)
            self._metrics.phase_latency.labels("decode").observe(time.perf_counter() - start)

    async def _decode_stream(self, node: Node, req: ProxyRequest, kv: list[Any], skipped: _Skip | None
                             ) -> NodeStream:
        """The decode node's stream, its lease (and "decode" span, tracing on) held until the stream closes."""
        kv = await skipped.kv_for(node) if skipped is not None else kv
        start = time.perf_counter()
        release = self._decode.acquire(node, req.decode_tokens)
        span = tracing.start_span("decode", "client") if tracing.enabled() else None
        try:
            with tracing.use(span):
                stream = await open_stream(self._client, node, req.endpoint, decode_body(req, self._model_name(), kv),
                                           tracing.inject())
        except BaseException:
            release()
            tracing.end(span)
            raise
        self._metrics.phase_latency.labels("decode_first_byte").observe(time.perf_counter() - start)

        def closed() -> None:
            release()
            tracing.end(span)
            self._metrics.phase_latency.labels("decode").observe(time.perf_counter() - start)
        stream.on_close = closed                  # the lease lasts as long as the stream
        return stream

    async def _retrying(self, pool: NodePool, keys: list[str], call: Callable[[Node], Awaitable[T]],
                        hint: KVHint | None = None) -> T:
        tried: set[str] = set()
        last: NodeFailed | None = None
        for attempt in range(self._max_attempts):
            try:
                node = pool.choose(keys, exclude=tried, hint=hint)
            except NoHealthyNode as exc:
                if last is not None and not last.down:
                    raise last from None
                raise NoHealthyNode(f"{exc}; {last}" if last else str(exc)) from None
            tried.add(node.url)
            if attempt:
                self._metrics.retries.labels(pool.role).inc()
            try:
                return await call(node)
            except NodeFailed as exc:
                logger.warning("%s (attempt %d of %d)", exc, attempt + 1, self._max_attempts)
                if exc.unreachable:
                    pool.mark_failed(node, str(exc))
                last = exc
        assert last is not None
        raise last


class _Skip:
    """A request routed past the prefill node (``store_hit``, ``decode_local``): per decode attempt, the
    ``kv_transfer_params`` to send -- none where the node may compute the rest itself (``KVRouting.skips_on``),
    else, once, a prefill node's (a retry that left the warm node ``decode_local`` counted on lands on a cold
    one: it gets the prompt's KV as the prefill path would give it, not a whole prompt to prefill)."""

    def __init__(self, orchestrator: Orchestrator, req: ProxyRequest, route: Route):
        self._o, self._req, self._route = orchestrator, req, route
        self._prefilled: list[Any] | None = None

    async def kv_for(self, node: Node) -> list[Any]:
        if self._prefilled is None and not self._o._kv.skips_on(self._route, self._req, node):
            logger.info("%s was planned on another decode node; %s lacks the prompt's KV: prefill first",
                        self._route.decision, node.url)
            try:
                self._prefilled = [p.get("kv_transfer_params") for p in await self._o.prefill(self._req, self._route)]
            except (NodeFailed, NoHealthyNode) as exc:
                raise _PrefillFailed(exc) from exc          # not the decode node's failure: no retry, no mark
            self._o._metrics.pd_decisions.labels("prefill").inc()
        return self._prefilled or [None] * len(self._req.prompts)

    def shown(self, shown: dict | None) -> dict | None:
        """``usage.kv_transfer.route`` once a retry went through a prefill node."""
        if shown is None or self._prefilled is None:
            return shown
        return {**shown, "decision": "prefill", "planned": self._route.decision}


class _PrefillFailed(Exception):
    """A skipped request's fallback prefill failed: raised past the decode retries as the prefill's error."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


async def _unwrapped(call: Awaitable[T]) -> T:
    try:
        return await call
    except _PrefillFailed as exc:
        raise exc.error from None


async def _all_or_cancel(calls: list[Awaitable[T]]) -> list[T]:
    """Results in order; the first failure cancels the calls still running and is raised."""
    if len(calls) == 1:                      # one prompt: no task of its own (the common case, a task less)
        return [await calls[0]]
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


class RelayResponse(StreamingResponse):
    """Streams a decode node's SSE events to the client; whatever way it ends (done, broken,
    client gone, even before the first event), the node's stream is closed and ``on_end`` runs once.
    ``redact``, if given, rewrites each event on its way (``accounting``)."""

    def __init__(self, stream: NodeStream, on_end: OnEnd, redact: Callable[[bytes], bytes] | None = None):
        self._stream, self._on_end, self.outcome, self._redact = stream, on_end, "aborted", redact
        self._events = self._relay()
        super().__init__(self._events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
                await self._stream.aclose()
            self._on_end(self.outcome)

    async def _relay(self) -> AsyncIterator[bytes]:
        """Pass events through unchanged; a broken stream ends with an error event and [DONE]."""
        saw_done = False
        try:
            async for batch in self._stream.batches():       # events that arrived together leave together
                saw_done = saw_done or any(event.startswith(DONE) for event in batch)
                yield b"".join(batch if self._redact is None else map(self._redact, batch))
            if not saw_done:
                raise ConnectionBroken("the stream ended without data: [DONE]")
            self.outcome = "ok"
        except Exception as exc:               # noqa: BLE001 -- whatever broke, the client gets an event, not a cut
            self.outcome = "stream_error"
            message = f"decode node {self._stream.node.url} failed mid-stream: {type(exc).__name__}: {exc}"
            logger.warning("%s", message, exc_info=not isinstance(exc, HTTPError))
            yield b"data: " + json.dumps(error_body(502, message)).encode() + b"\n\n" + DONE
