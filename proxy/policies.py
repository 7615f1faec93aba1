"""Routing policies: pick one node among the healthy candidates of a pool.

Called by ``router.NodePool.choose`` with the candidates (healthy, not yet tried for this
request, never empty) and the prompt's routing chunk keys. Policies are chosen separately
for prefill and decode (``--prefill-policy``, ``--decode-policy``):

- ``round_robin``:  the next node in URL order after the one picked last time.
- ``least_loaded``: fewest in-flight requests, then fewest in-flight tokens, then URL order.
- ``prefix_aware``: the node whose recently routed chunk keys cover the most leading chunks
  of this prompt (its prefix cache most likely holds them); ties go to the least loaded.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.proxy.nodes import Node


class Policy(Protocol):
    def choose(self, candidates: list[Node], chunk_keys: list[str]) -> Node: ...


class RoundRobin:
    def __init__(self) -> None:
        self._last_url: str | None = None

    def choose(self, candidates: list[Node], chunk_keys: list[str]) -> Node:
        ordered = sorted(candidates, key=lambda n: n.url)
        after = [n for n in ordered if self._last_url is not None and n.url > self._last_url]
        node = (after or ordered)[0]
        self._last_url = node.url
        return node


class LeastLoaded:
    def choose(self, candidates: list[Node], chunk_keys: list[str]) -> Node:
        return min(candidates, key=lambda n: (n.load, n.url))


class PrefixAware:
    def choose(self, candidates: list[Node], chunk_keys: list[str]) -> Node:
        return min(candidates, key=lambda n: (-n.recent_keys.leading_overlap(chunk_keys), n.load, n.url))


def make_policy(name: str) -> Policy:
    policies = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix_aware": PrefixAware}
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(policies)}")
    return policies[name]()
