"""Review 40: ``decode_local`` counts the busiest warm decode node's cache, but ``kv_aware`` may send it elsewhere.

proxy/kv_routing.py:132 (``plan``): with the kv_aware decode policy the decision takes ``max`` of the decode nodes'
cached prefixes ("the decode pool picks the node holding most of the prompt"). kv_aware does not: ``kv_cost``
(proxy/policies.py:41) adds ``IN_FLIGHT_COST["decode"] x in_flight_tokens`` (0.05/token), so a warm node with more than
20 x the prompt's cached tokens in flight (5000 for a 200-token prompt: a dozen requests of 400) costs more than an idle cold one,
and the request goes to the cold node -- with ``decode_local`` decided, i.e. with no prefill node: the cold decode
node prefills the whole prompt itself, far over ``--local-prefill-threshold``, stalling its running decodes
(the inverse of what the threshold bounds). Same class as test_review40's round-robin case, through load.

Correct: the decision counts the cache of the node the policy will pick for this hint (or the pick follows the
decision): after ``decode_local``, the chosen node lacks fewer than the threshold's tokens.
Real objects only: ``KVRouting``, ``NodePool("kv_aware")``, ``Node``s whose KV state holds verified-looking blocks.
"""

from __future__ import annotations

import asyncio
import time

from pdserve.proxy.inputs import Prompt, ProxyRequest
from pdserve.proxy.kv_routing import KVRouting
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.router import NodePool

THRESHOLD = 32


def test_decode_local_is_not_sent_to_a_cold_node_because_the_warm_one_is_busy():
    metrics = ProxyMetrics()
    kv = KVRouting(metrics, token="r40b" * 12, local_prefill_threshold=THRESHOLD)
    kv.block_size = 4
    pool = NodePool("decode", ("http://warm", "http://cold"), "kv_aware", metrics)
    for node in pool.nodes:
        node.healthy = True
    warm, cold = sorted(pool.healthy, key=lambda n: n.url != "http://warm")
    blocks = tuple(range(100, 150))                                  # 200 tokens in blocks of 4
    warm.kv.blocks, warm.kv.heard = set(blocks), time.monotonic()
    release = pool.acquire(warm, 5000)                               # ~a dozen requests of 400 decoding there
    req = ProxyRequest("/v1/completions", {}, [Prompt([1] * 200, [], blocks)], False, 8)

    async def main():
        route = await kv.plan(req, pool.healthy, pool.picks_by_cache)
        node = pool.choose(req.chunk_keys, hint=route.hint())
        await kv.stop()
        return route, node

    route, node = asyncio.run(main())
    release()
    lacking = 200 - route.hint().local_tokens(node)
    assert route.decision != "decode_local" or lacking < THRESHOLD, \
        f"decode_local sent to {node.url}, which must prefill {lacking} tokens itself (threshold {THRESHOLD})"
