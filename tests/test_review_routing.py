"""Hostile review of KV-event replay and Redis lookups (engine/kv/kv_replay.py, proxy/kv_events.py,
kvstore/redis_tier.py): real publishers' PUB + ROUTER sockets on 127.0.0.1, the proxy's subscriber, a real Redis.

- A peer past CURVE (it knows the server key) floods the replay ROUTER with unsigned requests: the node logs a
  bounded number of warnings (not one line per message) and still answers the proxy.
- A signed request captured once (by a local user squatting a dead node's replay port) and sent again and again:
  the node answers it once, not once per copy (each answer is a snapshot of up to 131072 hashes, ~1.2 MB).
- A node restarted on the same --kv-events-port has a new replay port: the proxy asks the new one.
- A planted value of another type (a hash) under one stored object's Redis key: that object is a miss, the others
  in the same read still load and the Redis tier is not marked down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import pytest
import zmq

from pdserve.engine.kv import kv_curve, kv_replay
from pdserve.engine.kv.kv_events import KVEventPublisher, events_key, public_hash
from pdserve.proxy import kv_events as proxy_events
from pdserve.proxy.inputs import Prompt
from pdserve.proxy.kv_events import EventSubscriber
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.nodes import Node

TOKEN = "r" * 32
KEY = kv_replay.replay_key(events_key(TOKEN))
REDIS = "redis://127.0.0.1:6379/0"


def _dealer(endpoint: str):
    """A client that completes the CURVE handshake (it knows the token): what follows tests the MAC layer."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    kv_curve.connect_to(sock, kv_curve.server_keys(TOKEN))
    sock.connect(endpoint)
    return sock


def _replies(sock, deadline_s: float) -> list[list[bytes]]:
    """Every reply that arrives until nothing more comes for ``deadline_s``."""
    out = []
    while sock.poll(int(deadline_s * 1000)):
        out.append(sock.recv_multipart())
    return out


@pytest.fixture
def publisher():
    pub = KVEventPublisher(TOKEN)
    yield pub
    pub.close()


def test_a_flood_without_the_token_logs_a_bounded_number_of_warnings(publisher, caplog):
    sock = _dealer(publisher.replay_endpoint)
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.engine.kv.kv_replay"):
            for i in range(2000):
                sock.send_multipart([kv_replay.TOPIC, i.to_bytes(16, "little"), b"\0" * 32])
            sock.send_multipart(kv_replay.request_frames(KEY, os.urandom(16)))   # after the flood, in order
            assert sock.poll(10_000), "the node still answers a signed request after the flood"
            sock.recv_multipart()
        dropped = [r for r in caplog.records if "KV replay request" in r.getMessage()]
        assert 1 <= len(dropped) <= 10, f"{len(dropped)} warnings for 2000 unsigned requests"
    finally:
        sock.close()


def test_a_captured_signed_request_sent_again_is_answered_once(publisher):
    publisher.publish([("stored", h) for h in range(1000)])
    request = kv_replay.request_frames(KEY, os.urandom(16))
    sock = _dealer(publisher.replay_endpoint)
    try:
        for _ in range(50):
            sock.send_multipart(request)
        replies = _replies(sock, 0.3)
        assert len(replies) == 1, f"one captured request got {len(replies)} snapshots"
    finally:
        sock.close()


def test_a_node_restarted_on_the_same_events_port_is_replayed_from_its_new_replay_port(monkeypatch):
    monkeypatch.setattr(proxy_events, "REPLAY_TIMEOUT_S", 0.3)
    old = KVEventPublisher(TOKEN)
    port = int(old.endpoint.rsplit(":", 1)[1])

    async def main():
        metrics = ProxyMetrics()
        sub, node = EventSubscriber(TOKEN, metrics), Node("http://n", "decode")
        failed = metrics.kv_events.labels("replay_failed")
        new = None
        try:
            sub.watch(node, old.endpoint, old.replay_endpoint)
            await _until(lambda: node.kv.epoch == old._epoch, 5, "the first process's heartbeat")
            old.close()
            new = _bind_again(port)                      # the same PUB endpoint, another replay port
            new.publish([("stored", h) for h in (1, 2, 3)])   # batch 1, most likely before the SUB reconnects
            assert new.endpoint == old.endpoint and new.replay_endpoint != old.replay_endpoint
            wanted = {public_hash(events_key(TOKEN), h) for h in (1, 2, 3)}
            # missing batch 1, the proxy asks the old (dead) replay port before it reads the new card
            await _until(lambda: failed._value.get() >= 1 or node.kv.blocks == wanted, 5, "a replay or batch 1")
            if not failed._value.get():
                pytest.skip("the proxy's SUB reconnected before batch 1: no replay was needed")
            sub.watch(node, new.endpoint, new.replay_endpoint)        # the proxy reads the new card
            await _until(lambda: node.kv.blocks == wanted, 5, "the new process's blocks, replayed")
        finally:
            await sub.stop()
            if new is not None:
                new.close()

    asyncio.run(main())


def _bind_again(port: int) -> KVEventPublisher:
    """A publisher on ``port`` once the closed one's socket has let it go (zmq closes in its I/O thread)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return KVEventPublisher(TOKEN, port)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


async def _until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
def redis_prefix():
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(REDIS, socket_timeout=1)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis on 127.0.0.1:6379: {exc}")
    prefix = f"pdkv-review-routing-{os.getpid()}-{os.urandom(4).hex()}:"
    yield client, prefix
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.mark.parametrize("plant", ["hash", "list"])
def test_junk_of_another_type_under_a_redis_key_is_one_miss_not_a_tier_outage(redis_prefix, plant):
    import torch

    from pdserve.kvstore.config import KVStoreConfig, build_store

    client, prefix = redis_prefix
    store = build_store(KVStoreConfig(cpu_bytes=1 << 20, redis_url=REDIS, redis_prefix=prefix))
    try:
        data = torch.arange(250.0)
        store.put([("c1:0", data), ("c2:0", data + 1)])
        assert store.flush()
        store.l1.delete(["c1:0", "c2:0"])
        client.delete(prefix + "c1:0")              # a local user plants junk of another type in its place
        client.hset(prefix + "c1:0", "x", "y") if plant == "hash" else client.rpush(prefix + "c1:0", "x")
        got = store.get(["c1:0", "c2:0"])
        assert got[0] is None and got[1] is not None and torch.equal(got[1], data + 1)
        assert store.health["redis"].available(), "one planted key took the Redis tier down"
        assert store.lower[0].lookup(["c2"], 1) == 1    # the proxy's Redis lookup does not trip on it either
    finally:
        store.close()


def test_a_proxy_reading_redis_under_another_prefix_than_the_nodes_says_so(tiny_llama, redis_prefix):
    """Nodes write under one prefix, the proxy reads another: every lookup misses. It must be visible (a metric per
    node, and a warning), not look like a cold cache."""
    import httpx

    from polling import wait_until
    from pdserve.proxy.cluster import ClusterSpec, LocalCluster

    client, prefix = redis_prefix
    spec = ClusterSpec(prefill=1, decode=1, kv_routing=True, store="embedded", kv_redis=REDIS,
                       node_flags=("--block-size", "4", "--kv-chunk-tokens", "8", "--kv-redis-prefix", prefix),
                       proxy_flags=("--routing-policy", "kv_aware", "--kv-redis-prefix", prefix + "other:"))
    with LocalCluster(str(tiny_llama), spec) as cluster:
        def mismatched() -> list[str]:
            text = httpx.get(cluster.url + "/metrics", timeout=10).text
            return [l for l in text.splitlines() if l.startswith("pdserve_proxy_kv_redis_prefix_mismatch{")
                    and float(l.rsplit(" ", 1)[1]) == 1.0]

        wait_until(lambda: len(mismatched()) == 2, 30, "the proxy's metric naming both nodes' other prefix")


def test_a_proxy_whose_redis_cluster_is_down_at_start_routes_without_it():
    """``--kv-store redis+cluster://`` with the cluster unreachable when the proxy starts: a miss per lookup, counted,
    not a proxy that cannot start (redis-py's cluster client connects in its constructor)."""
    import socket

    from pdserve.proxy.kv_routing import KVRouting

    with socket.socket() as s:                      # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = ProxyMetrics()
    routing = KVRouting(metrics, f"redis+cluster://127.0.0.1:{port}", TOKEN)
    routing.store_space = {"fingerprint": "f" * 32, "chunk_tokens": 8, "num_layers": 2}

    async def main():
        try:
            assert await routing._stored_tokens([Prompt(list(range(16)), ["k1", "k2"], ())]) == [0]
        finally:
            await routing.stop()

    asyncio.run(main())
    assert metrics.store_lookups.labels("error")._value.get() == 1
