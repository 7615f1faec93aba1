"""Review 40: a long prompt's store lookup is one ``Lookup`` of chunks x layers keys, over the daemon's batch limit.

``DaemonClient.lookup`` (kvstore/client.py:113) sends every chunk key of the prompt in one ``P.Lookup``; the daemon
(kvstore/daemon.py:299, ``_lookup``) refuses any whose ``len(chunk_keys) * num_layers`` exceeds ``max_batch``
(4096 by default) with ``ok=False``. ``contains``/``get``/``delete`` split their keys into batches; ``lookup`` does
not. So with the defaults (``--kv-chunk-tokens 256``) a 32-layer model's prompt over 32k tokens (an 80-layer model's
over 13k; any model's sooner with smaller chunks) is never found in the store, and -- worse -- the error is taken for
a store outage:

* the proxy (proxy/kv_routing.py, ``_stored_tokens``) counts ``error`` and marks the store failing: for
  ``STORE_RETRY_S`` every other request routes without a lookup (``skipped``);
* a node's loader (decode/loader.py:89) reports it to its health gate: the node stops asking the store at all.

Correct: a lookup of a long prompt answers (the leading chunks present, in batches the daemon takes, as the other
operations do) and no long prompt makes the store look down to anyone.
Reproduced with a real daemon process (``python -m pdserve.kvstore`` with the cluster token) and small chunks.
"""

from __future__ import annotations

import asyncio

import torch

from kvstore_fixtures import TOKEN, DaemonProcess
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.keys import chunk_keys, object_key
from pdserve.proxy.inputs import Prompt, ProxyRequest
from pdserve.proxy.kv_routing import KVRouting
from pdserve.proxy.metrics import ProxyMetrics

LAYERS = 32                     # a Llama-3-8B's
CHUNK = 16
SPACE = {"fingerprint": "cd" * 16, "chunk_tokens": CHUNK, "num_layers": LAYERS}
LONG = 4096 // LAYERS + 8       # chunks: 136 x 32 layers = 4352 objects > the daemon's max_batch (4096)


def _keys(seed: int, chunks: int) -> tuple[list[int], list[str]]:
    ids = [(seed * 7919 + i) % 30000 for i in range(chunks * CHUNK)]
    return ids, chunk_keys(ids, CHUNK, SPACE["fingerprint"], include_partial=True)


def test_a_long_prompts_lookup_answers_and_does_not_mark_the_store_down():
    daemon = DaemonProcess("--kv-cpu-bytes", str(64 << 20), token=TOKEN)
    client = DaemonClient(daemon.url, TOKEN)
    try:
        long_ids, long_keys = _keys(1, LONG)
        short_ids, short_keys = _keys(2, 4)
        tiny = torch.zeros(4)
        client.put([(object_key(k, layer), tiny) for k in long_keys + short_keys for layer in range(LAYERS)])
        assert client.lookup(short_keys, LAYERS) == 4

        metrics = ProxyMetrics()
        kv = KVRouting(metrics, store_url=daemon.url, token=TOKEN)
        kv.store_space, kv.block_size = dict(SPACE), 4

        def req(ids, keys):
            return ProxyRequest("/v1/completions", {}, [Prompt(ids, keys)], False, 8)

        async def main():
            long_route = await kv.plan(req(long_ids, long_keys), [])
            short_route = await kv.plan(req(short_ids, short_keys), [])     # another user's prompt, right after
            await kv.stop()
            return long_route, short_route

        long_route, short_route = asyncio.run(main())
        errors = metrics.store_lookups.labels("error")._value.get()
        skipped = metrics.store_lookups.labels("skipped")._value.get()
        # every chunk of both prompts is in the store
        assert short_route.decision == "store_hit", (short_route, f"errors={errors} skipped={skipped}: the long "
                                                     "prompt's lookup marked the store down for everyone")
        assert long_route.decision == "store_hit", (long_route, errors)
        assert client.lookup(long_keys, LAYERS) == LONG
    finally:
        client.close()
        daemon.stop()


def test_a_long_prompts_lookup_on_a_node_does_not_take_the_store_down_for_its_other_requests():
    """The node's side (decode/loader.py:89, ``ChunkLoader.lookup``): the same refusal goes to the health gate the
    loader shares with the publisher, so after one long prompt the node neither looks up nor loads (nor, sharing
    that gate, publishes) anything for the back-off: a short prompt stored in full is a 0-token hit."""
    from pdserve.decode.loader import ChunkLoader
    from pdserve.kvstore.health import TierHealth

    daemon = DaemonProcess("--kv-cpu-bytes", str(64 << 20), token=TOKEN)
    client = DaemonClient(daemon.url, TOKEN)
    health = TierHealth("daemon")
    loader = ChunkLoader(client, [{} for _ in range(LAYERS)], 0, (2, 1, 4), health, b"k" * 32, chunk_tokens=CHUNK)
    try:
        _, long_keys = _keys(3, LONG)
        _, short_keys = _keys(4, 4)
        tiny = torch.zeros(4)
        client.put([(object_key(k, layer), tiny) for k in long_keys + short_keys for layer in range(LAYERS)])
        long_hit = loader.lookup(long_keys, [CHUNK] * LONG)
        short_hit = loader.lookup(short_keys, [CHUNK] * 4)
        assert (long_hit, short_hit, health.down) == (LONG * CHUNK, 4 * CHUNK, False)
    finally:
        client.close()
        daemon.stop()


def test_after_one_long_prompt_a_p_d_cluster_transfers_no_kv_for_a_short_one(tmp_path):
    """End to end, the consequence: a 32-layer model (a tiny one: hidden 64) with ``--block-size 4
    --kv-chunk-tokens 4`` (128 chunks x 32 layers is the daemon's 4096), a real daemon, prefill node, decode node and
    proxy. A 600-token prompt makes both nodes' lookups fail (``num_loadable_tokens`` -> ``ChunkLoader.lookup``),
    which marks each node's store gate down (``TierHealth("kv-store", base_s=2.0)``, shared by loader and
    publisher): for the back-off the prefill node skips its puts and the decode node its lookups. A short prompt
    sent right after is answered, but no KV crosses: the decode node recomputes every token (``loaded_tokens`` 0)
    -- with no long prompt before, it loads them (the control). Correct: the short prompt's KV is transferred whatever prompt came before."""
    import httpx

    from pdserve.engine.checkpoints.tiny_model import make_tiny_model
    from pdserve.proxy.cluster import ClusterSpec, LocalCluster

    model = make_tiny_model(tmp_path / "llama32", arch="llama", seed=0, num_layers=LAYERS)
    spec = ClusterSpec(prefill=1, decode=1, node_flags=("--block-size", "4", "--kv-chunk-tokens", "4"))

    def complete(url: str, prompt: list[int]) -> dict:
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    short = [(17 * i + 3) % 400 + 20 for i in range(64)]
    long_ = [(13 * i + 5) % 400 + 20 for i in range(600)]
    with LocalCluster(str(model), spec) as cluster:
        control = complete(cluster.url, [t + 1 for t in short])["usage"]["kv_transfer"]["decode"]
        assert control["loaded_tokens"] > 0, control                      # the P/D path transfers KV
        complete(cluster.url, long_)
        after = complete(cluster.url, short)["usage"]["kv_transfer"]["decode"]
    assert after["loaded_tokens"] > 0, f"the short prompt after a long one: {after}"
