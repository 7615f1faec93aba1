"""One pool of nodes per role and the choice of a node for one request.

Built by ``app.build_app`` from the config; ``orchestrate`` calls, per phase and attempt:

    node = pool.choose(chunk_keys, exclude=tried, hint=hint)    # NoHealthyNode when none is left (hint: kv_aware)
    with pool.lease(node, tokens):                   # in-flight counts (or acquire() -> release)
        ... call the node ...                        # pool.mark_failed(node, why) if unreachable

``health.HealthChecker`` calls ``set_health`` after every probe.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable, Iterator

from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.nodes import Node
from pdserve.proxy.policies import KVAware, KVHint, make_policy

logger = logging.getLogger(__name__)


class NoHealthyNode(Exception):
    """No healthy node of this role is left to try for a request."""


class NodePool:
    def __init__(self, role: str, urls: tuple[str, ...], policy: str, metrics: ProxyMetrics):
        self.role = role
        self.nodes = [Node(url.rstrip("/"), role) for url in urls]
        self._policy = make_policy(policy)
        self._metrics = metrics
        for node in self.nodes:
            metrics.healthy.labels(role, node.url).set(0)
            metrics.in_flight.labels(role, node.url).set(0)

    @property
    def healthy(self) -> list[Node]:
        return [n for n in self.nodes if n.healthy]

    @property
    def picks_by_cache(self) -> bool:
        """Its policy picks the node holding most of the prompt (``kv_aware``), so ``kv_routing`` may count on it."""
        return isinstance(self._policy, KVAware)

    def choose(self, chunk_keys: list[str], exclude: set[str] = frozenset(), hint: KVHint | None = None) -> Node:
        candidates = [n for n in self.healthy if n.url not in exclude]
        if not candidates:
            raise NoHealthyNode(f"no healthy {self.role} node left to try (healthy: "
                                f"{[n.url for n in self.healthy]}, already tried: {sorted(exclude)})")
        node = self._policy.choose(candidates, chunk_keys, hint)
        node.recent_keys.add(chunk_keys)
        return node

    @contextmanager
    def lease(self, node: Node, tokens: int) -> Iterator[Node]:
        release = self.acquire(node, tokens)
        try:
            yield node
        finally:
            release()

    def acquire(self, node: Node, tokens: int) -> Callable[[], None]:
        """Count one request of ``tokens`` tokens in flight on ``node``; returns its idempotent release."""
        self._add(node, 1, tokens)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._add(node, -1, -tokens)
        return release

    def _add(self, node: Node, requests: int, tokens: int) -> None:
        node.in_flight += requests
        node.in_flight_tokens += tokens
        self._metrics.in_flight.labels(self.role, node.url).set(node.in_flight)

    def set_health(self, node: Node, ok: bool, why: str = "") -> None:
        if ok != node.healthy:
            if ok:
                logger.info("%s node %s is healthy", self.role, node.url)
            else:
                logger.warning("%s node %s taken out of rotation: %s", self.role, node.url, why)
        node.healthy = ok
        self._metrics.healthy.labels(self.role, node.url).set(int(ok))

    def mark_failed(self, node: Node, why: str) -> None:
        """A request could not reach the node: out of rotation until a probe passes again."""
        self.set_health(node, False, why)
