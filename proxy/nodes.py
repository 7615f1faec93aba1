"""The proxy's view of the engine nodes: health, load and the prefix chunks recently sent to each.

Owned by ``router.NodePool``; mutated by ``health.HealthChecker`` (healthy or not), ``kv_events`` (``kv``), by
``orchestrate`` through ``NodePool.lease`` (in-flight counts) and ``mark_failed`` (a request
could not reach the node), and read by ``policies`` when they choose a node.
Everything runs on the proxy's one event loop, so there are no locks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.proxy.kv_state import NodeKVState


@dataclass
class Node:
    url: str
    role: str                                  # "prefill" or "decode"
    healthy: bool = False                      # until the first probe answers 200
    in_flight: int = 0                         # requests this proxy has open on the node
    in_flight_tokens: int = 0                  # their prompt (+ max output) tokens
    recent_keys: "RecentKeys" = field(default_factory=lambda: RecentKeys(capacity=50_000))
    kv: NodeKVState = field(default_factory=NodeKVState)   # its prefix cache, from its KV events (kv_aware)

    @property
    def load(self) -> tuple[int, int]:
        """Least-loaded order: in-flight requests first, then in-flight tokens."""
        return self.in_flight, self.in_flight_tokens


class RecentKeys:
    """A bounded LRU set of the chunk keys of prompts recently routed to one node."""

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity

    def add(self, keys: list[str]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)

    def leading_overlap(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first on, this node has seen (a chain breaks at the first miss)."""
        count = 0
        for key in keys:
            if key not in self._keys:
                break
            count += 1
        return count

    def __len__(self) -> int:
        return len(self._keys)
