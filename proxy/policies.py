"""Routing policies: pick one node among the healthy candidates of a pool.

Called by ``router.NodePool.choose`` with the candidates (healthy, not yet tried for this
request, never empty) and the prompt's routing chunk keys. Policies are chosen separately
for prefill and decode (``--prefill-policy``, ``--decode-policy``):

- ``round_robin``:  the next node in URL order after the one picked last time.
- ``least_loaded``: fewest in-flight requests, then fewest in-flight tokens, then URL order.
- ``prefix_aware``: the node whose recently routed chunk keys cover the most leading chunks
  of this prompt (its prefix cache most likely holds them); ties go to the least loaded.
- ``kv_aware``: the node with the least estimated work for this prompt, from what the node's KV events say its
  prefix cache holds (``node.kv``), what the shared store holds (``KVHint.store_tokens``, one lookup per
  request) and its load (``kv_cost``); without a hint (no events, no store) it is ``least_loaded``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdserve.proxy.nodes import Node

LOAD_FROM_STORE_COST = 0.1   # loading a token's KV from the store, in tokens computed (a copy vs. a forward pass)
# each token in flight on the node, in tokens computed: on a prefill node a prompt being computed (it delays this one
# about token for token); on a decode node mostly generation, batched with this request's (prompt + max output)
IN_FLIGHT_COST = {"prefill": 0.5, "decode": 0.05}


@dataclass(frozen=True)
class KVHint:
    """What ``kv_routing`` knows of one prompt when its nodes are chosen."""
    num_tokens: int
    block_size: int
    block_hashes: tuple[int, ...]     # public hashes of its full blocks (``engine.kv.kv_events.public_hash``)
    store_tokens: int                 # leading tokens the shared store holds

    def local_tokens(self, node: Node) -> int:
        return node.kv.leading_blocks(list(self.block_hashes)) * self.block_size


def kv_cost(node: Node, hint: KVHint) -> float:
    """Estimated work of the prompt on ``node``, in tokens: what neither its prefix cache nor the store holds,
    plus the loads from the store, plus a share of what it already has in flight (``IN_FLIGHT_COST`` by role)."""
    local = hint.local_tokens(node)
    cached = max(local, hint.store_tokens)
    return (hint.num_tokens - cached) + LOAD_FROM_STORE_COST * max(0, hint.store_tokens - local) + \
        IN_FLIGHT_COST.get(node.role, 0.5) * node.in_flight_tokens


class Policy(Protocol):
    def choose(self, candidates: list[Node], chunk_keys: list[str], hint: KVHint | None = None) -> Node: ...


class RoundRobin:
    def __init__(self) -> None:
        self._last_url: str | None = None

    def choose(self, candidates: list[Node], chunk_keys: list[str], hint: KVHint | None = None) -> Node:
        ordered = sorted(candidates, key=lambda n: n.url)
        after = [n for n in ordered if self._last_url is not None and n.url > self._last_url]
        node = (after or ordered)[0]
        self._last_url = node.url
        return node


class LeastLoaded:
    def choose(self, candidates: list[Node], chunk_keys: list[str], hint: KVHint | None = None) -> Node:
        return min(candidates, key=lambda n: (n.load, n.url))


class PrefixAware:
    def choose(self, candidates: list[Node], chunk_keys: list[str], hint: KVHint | None = None) -> Node:
        return min(candidates, key=lambda n: (-n.recent_keys.leading_overlap(chunk_keys), n.load, n.url))


class KVAware:
    def choose(self, candidates: list[Node], chunk_keys: list[str], hint: KVHint | None = None) -> Node:
        if hint is None:
            return min(candidates, key=lambda n: (n.load, n.url))
        return min(candidates, key=lambda n: (kv_cost(n, hint), n.load, n.url))


def make_policy(name: str) -> Policy:
    policies = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix_aware": PrefixAware,
                "kv_aware": KVAware}
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(policies)}")
    return policies[name]()
