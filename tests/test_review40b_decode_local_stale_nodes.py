"""Review 40b: ``decode_local`` is decided on the cache of a decode node that left rotation during the store lookup.

proxy/kv_routing.py:137-144 (``plan``) / proxy/orchestrate.py:105: ``orchestrate`` evaluates
``self._decode.healthy`` (a snapshot list) when it calls ``plan``; ``plan`` then awaits the store lookup (up to
``STORE_TIMEOUT_S``, 2 s) and only afterwards predicts the decode node with ``KVAware().choose(decode_nodes, ...)``
over that stale snapshot. If a health probe (or a failed call: ``NodePool.mark_failed``) takes the warm node out of
rotation while the lookup is in flight, the prediction still picks it -- ``decode_local`` is decided on its cache --
but ``NodePool.choose`` right after only sees the healthy nodes and sends the request to a cold node, which then
prefills the whole prompt itself (far over ``--local-prefill-threshold``) with no prefill node involved.
The module docstring promises "best" is "the node kv_aware will pick".

Correct: the prediction uses the nodes that are candidates when the decision is made (read the pool's healthy nodes
after the lookup), so after ``decode_local`` the node actually chosen lacks fewer than the threshold's tokens.
Real parts: ``KVRouting`` asking a real redis-server (``--kv-store redis://``), ``NodePool("kv_aware")``, ``Node``s.
"""

from __future__ import annotations

import asyncio
import threading
import time

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures
from pdserve.kvstore.keys import chunk_keys
from pdserve.proxy.inputs import Prompt, ProxyRequest
from pdserve.proxy.kv_routing import KVRouting
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.router import NodePool

THRESHOLD = 32
SPACE = {"fingerprint": "ab" * 16, "chunk_tokens": 8, "num_layers": 2}


def test_decode_local_not_decided_on_a_node_that_left_rotation_during_the_lookup(own_redis):
    metrics = ProxyMetrics()
    kv = KVRouting(metrics, store_url=own_redis.url, token="r40b" * 12, local_prefill_threshold=THRESHOLD,
                   redis_prefix="r40b-stale:")
    kv.store_space, kv.block_size = dict(SPACE), 4
    pool = NodePool("decode", ("http://warm", "http://cold"), "kv_aware", metrics)
    for node in pool.nodes:
        node.healthy = True
    warm = next(n for n in pool.nodes if n.url == "http://warm")
    blocks = tuple(range(100, 150))                                 # 200 tokens in blocks of 4, all on warm
    warm.kv.blocks, warm.kv.heard = set(blocks), time.monotonic()
    ids = list(range(200))
    req = ProxyRequest("/v1/completions", {}, [Prompt(ids, chunk_keys(ids, 8, SPACE["fingerprint"],
                                                                          include_partial=True), blocks)], False, 8)

    # the lookup (a thread, against the real server) waits until the probe below has failed warm: a fast store
    # must not finish it before the test gets to fail the node (CI saw that race)
    started, probed, lookup = threading.Event(), threading.Event(), kv._lookup

    def gated_lookup(keys):
        started.set()
        assert probed.wait(10), "the test never failed the warm node"
        return lookup(keys)

    kv._lookup = gated_lookup

    async def main():
        # as orchestrate does: the healthy nodes, read by plan after its lookup
        task = asyncio.ensure_future(kv.plan(req, lambda: pool.healthy, pool.picks_by_cache))
        assert await asyncio.to_thread(started.wait, 10), "precondition: plan asks the store"
        assert kv._pending and not task.done(), "precondition: plan is awaiting its store lookup"
        pool.mark_failed(warm, "health probe failed")
        probed.set()
        route = await task
        node = pool.choose(req.chunk_keys, hint=route.hint())     # orchestrate._retrying, right after plan
        await kv.stop()
        return route, node

    route, node = asyncio.run(main())
    assert metrics.store_lookups.labels("error")._value.get() == 0, "precondition: the store answered"
    lacking = 200 - route.hint().local_tokens(node)
    assert route.decision != "decode_local" or lacking < THRESHOLD, \
        f"decode_local sent to {node.url} (the warm node left rotation during the lookup), which must prefill " \
        f"{lacking} tokens itself (threshold {THRESHOLD})"
