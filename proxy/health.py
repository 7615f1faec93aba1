"""Periodic /health probes that take nodes out of rotation and bring them back.

Started and stopped by ``app``'s lifespan:

    checker = HealthChecker(pools, client, interval_s, timeout_s)
    await checker.probe_all()        # once before serving, so a ready cluster is ready at once
    checker.start() ... await checker.stop()

Every ``interval_s`` each node of each pool gets ``GET /health``; 200 within ``timeout_s``
puts it in rotation, anything else takes it out. The first healthy node's ``/v1/models``
names the model the proxy reports (unless ``--served-model-name`` is given).
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from pdserve.proxy.nodes import Node
from pdserve.proxy.router import NodePool

logger = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, pools: list[NodePool], client: httpx.AsyncClient, interval_s: float, timeout_s: float):
        self._pools, self._client = pools, client
        self._interval_s, self._timeout_s = interval_s, timeout_s
        self._task: asyncio.Task | None = None
        self.model_name: str | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="proxy-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

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
        try:
            response = await self._client.get(node.url + "/health", timeout=self._timeout_s)
            ok, why = response.status_code == 200, f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            ok, why = False, f"/health failed: {type(exc).__name__}: {exc}"
        pool.set_health(node, ok, why)
        if ok and self.model_name is None:
            self.model_name = await self._model_name(node)

    async def _model_name(self, node: Node) -> str | None:
        try:
            response = await self._client.get(node.url + "/v1/models", timeout=self._timeout_s)
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            logger.warning("could not read the model name from %s/v1/models: %s", node.url, exc)
            return None
