"""The proxy's side of the nodes' KV events: one ZMQ SUB per node, verified batches into ``node.kv``.

Who calls what (all on the proxy's event loop):

    ProxyState.on_card(node, card)   subscriber.watch(node, endpoint)    a node's /v1/models names its endpoint
                                                                         (again after a restart: a new port)
    app lifespan                     await subscriber.stop()
    per message                      decode_batch (MAC, bounds) -> node.kv.apply -> metrics

A message that fails its MAC or does not decode, or names another endpoint than the one it arrived from (a batch
of another node relayed by whoever took this node's port), is dropped and counted (``outcome="forged"``); one that
replays an old epoch or sequence is dropped as ``stale`` (``kv_state``). Watching a new endpoint for a node forgets what the
old one said. The socket only connects (to 127.0.0.1 endpoints the nodes bind); see docs/threat-model.md.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from pdserve.engine.kv.kv_events import decode_batch
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.nodes import Node

logger = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 2 << 20


class EventSubscriber:
    def __init__(self, key: bytes, metrics: ProxyMetrics):
        self._key, self._metrics = key, metrics
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, tuple[str, asyncio.Task]] = {}    # node url -> (endpoint, reader)

    def watch(self, node: Node, endpoint: str) -> None:
        """Read ``node``'s events from ``endpoint`` (a no-op if already so)."""
        current = self._tasks.get(node.url)
        if current is not None:
            if current[0] == endpoint:
                return
            current[1].cancel()
        node.kv.forget()
        self._metrics.node_cached_blocks.labels(node.role, node.url).set(0)
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        self._tasks[node.url] = (endpoint, asyncio.ensure_future(self._read(node, sock, endpoint)))
        logger.info("KV events of %s node %s from %s", node.role, node.url, endpoint)

    async def stop(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._ctx.term()

    async def _read(self, node: Node, sock, endpoint: str) -> None:
        try:
            while True:
                self.handle(node, await sock.recv_multipart(), endpoint)
        finally:
            sock.close()

    def handle(self, node: Node, frames: list[bytes], endpoint: str) -> str:
        """One message from ``node``'s socket at ``endpoint``; returns its outcome (accepted, reset, stale, forged)."""
        try:
            batch = decode_batch(self._key, frames)
            if batch.endpoint != endpoint:
                raise ValueError(f"a batch sent on {batch.endpoint or 'an unnamed socket'!r} arrived on {endpoint!r} "
                                 "(relayed from another node's socket, or a node older than the proxy)")
        except ValueError as exc:
            logger.warning("dropped a KV-event message on %s node %s's socket: %s", node.role, node.url, exc)
            outcome = "forged"
        else:
            outcome = node.kv.apply(batch)
        self._metrics.kv_events.labels(outcome).inc()
        if outcome == "reset":
            logger.info("%s node %s: KV-event state reset (restart, lost events or cleared cache)", node.role,
                        node.url)
        self._metrics.node_cached_blocks.labels(node.role, node.url).set(len(node.kv.blocks))
        return outcome
