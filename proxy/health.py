"""Periodic /health probes that take nodes out of rotation and bring them back.

Started and stopped by ``app``'s lifespan:

    checker = HealthChecker(pools, interval_s, timeout_s, on_down)
    await checker.probe_all()        # once before serving, so a ready cluster is ready at once
    checker.start() ... await checker.stop()

Every ``interval_s`` each node of each pool gets ``GET /health``; 200 within ``timeout_s``
puts it in rotation, anything else takes it out. A node that failed its probe in any way but a refused
connection -- no answer in time, or a non-200 -- also gets ``on_down(node, since, why)`` (``since``: when the
probe was sent, ``time.monotonic()``): ``orchestrate`` fails the calls in flight on it that have had no byte
from it since then, so no request outlives its node's health. A refused connection does not: nothing listens
there, because the node is gone (its connections were reset with it) or draining (its open calls go on).
Probes use their own small connection pool, never the request pool: with every pooled connection held by
slow requests a probe would otherwise wait for the pool, time out, and take healthy nodes out of rotation.
For the same reason a probe that times out waiting for a connection of its own pool (``PoolTimeout``: this
proxy is short of connections) is no verdict on the node and changes nothing.
Each node's ``/v1/models`` is read once it is healthy, and again each time it comes back (a restart may have
moved its KV-event endpoint); ``on_card(node, card)`` gets each card (``kv_routing``). The first names the model
the proxy reports
(unless ``--served-model-name`` is given), and ``max_model_len`` is the smallest any node reports
(the proxy refuses prompts that cannot fit it before tokenizing them, as a node would).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable

from pdserve.proxy.http1 import ConnectionPool, ConnectRefused, HTTPError, PoolTimeout
from pdserve.proxy.nodes import Node
from pdserve.proxy.router import NodePool

logger = logging.getLogger(__name__)
OnDown = Callable[[Node, float, str], None]      # (node, silent since: time.monotonic(), why)


class HealthChecker:
    def __init__(self, pools: list[NodePool], interval_s: float, timeout_s: float,
                 on_down: OnDown = lambda node, since, why: None, node_api_key: str | None = None,
                 on_card: Callable[[Node, dict], None] = lambda node, card: None):
        self._pools, self._on_down, self._on_card = pools, on_down, on_card
        self._interval_s, self._timeout_s = interval_s, timeout_s
        num_nodes = sum(len(pool.nodes) for pool in pools)
        self._client = ConnectionPool(2 * num_nodes, connect_timeout_s=timeout_s, timeout_s=timeout_s,
                                      bearer=node_api_key)
        self._task: asyncio.Task | None = None
        self._max_model_lens: dict[str, int | None] = {}   # per node that was read (None: no figure)
        self.model_name: str | None = None

    @property
    def max_model_len(self) -> int | None:
        return min((n for n in self._max_model_lens.values() if n is not None), default=None)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="proxy-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(pool, node) for pool in self._pools for node in pool.nodes))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.probe_all()
            except Exception:                       # a bug here must not stop probing forever
                logger.exception("health probe round failed")

    async def _probe(self, pool: NodePool, node: Node) -> None:
        sent, listening = time.monotonic(), True
        try:
            status = (await self._get(node.url, "/health"))[0]
            ok, why = status == 200, f"/health answered {status}"
        except PoolTimeout:
            logger.warning("health probe of %s waited too long for a connection; no verdict", node.url)
            return
        except HTTPError as exc:
            ok, why = False, f"/health failed: {type(exc).__name__}: {exc}"
            listening = not isinstance(exc, ConnectRefused)
        was_healthy = node.healthy
        pool.set_health(node, ok, why)
        if not ok and listening:
            self._on_down(node, sent, why)
        if ok and (node.url not in self._max_model_lens or not was_healthy):
            await self._read_model(node)

    async def _read_model(self, node: Node) -> None:
        self._max_model_lens[node.url] = None
        try:
            card = json.loads((await self._get(node.url, "/v1/models"))[1])["data"][0]
        except (HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            logger.warning("could not read the model card from %s/v1/models: %s", node.url, exc)
            return
        if self.model_name is None and isinstance(card.get("id"), str):
            self.model_name = card["id"]
        if isinstance(card.get("max_model_len"), int) and card["max_model_len"] > 0:
            self._max_model_lens[node.url] = card["max_model_len"]
        if isinstance(card, dict):
            try:
                self._on_card(node, card)
            except Exception:                       # noqa: BLE001 -- a bad card costs routing hints only
                logger.exception("could not use the model card of %s", node.url)

    async def _get(self, url: str, path: str) -> tuple[int, bytes]:
        """One GET and its whole answer (connecting, then the rest, each within ``timeout_s``)."""
        response = await self._client.fetch("GET", url, path)
        return response.status, response.content
