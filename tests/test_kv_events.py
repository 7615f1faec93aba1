"""KV events, node to proxy (issue 40): real ZMQ sockets, the real publisher and subscriber, a real tiny engine.

The engine's published hashes equal what the proxy computes for the same prompt (salted too); a forged, tampered
or replayed batch is dropped and counted; a node that restarts (a new epoch) or loses events is forgotten.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq

from pdserve.engine.kv import kv_curve
from pdserve.engine.kv.kv_events import (TOPIC, EventBatch, KVEventPublisher, decode_batch, encode_batch, events_key,
                                         public_hash)
from pdserve.proxy.inputs import Routing
from pdserve.proxy.kv_events import EventSubscriber
from pdserve.proxy.kv_state import NodeKVState
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.nodes import Node

TOKEN, OTHER = "t" * 32, "o" * 32
KEY = events_key(TOKEN)


def batch(epoch="e1", started=1.0, seq=1, **kw) -> EventBatch:
    return EventBatch(epoch, started, seq, **kw)


def test_batches_verify_only_with_the_cluster_key_and_untouched():
    frames = encode_batch(KEY, batch(stored=[1, 2]))
    assert decode_batch(KEY, frames).stored == [1, 2]
    with pytest.raises(ValueError, match="MAC"):
        decode_batch(events_key(OTHER), frames)                          # another cluster's key
    tampered = [frames[0], frames[1].replace(b"\x01", b"\x05"), frames[2]]
    with pytest.raises(ValueError, match="MAC"):
        decode_batch(KEY, tampered)
    with pytest.raises(ValueError, match="not a kv-events"):
        decode_batch(KEY, frames[:2])
    unsigned = msgspec.msgpack.encode(batch(stored=[7]))
    with pytest.raises(ValueError):
        decode_batch(KEY, [TOPIC, unsigned, b"\x00" * 32])


def test_public_hashes_are_keyed():
    assert public_hash(KEY, 123) == public_hash(KEY, 123) != public_hash(events_key(OTHER), 123)
    assert 0 <= public_hash(KEY, 2**64 - 1) < 2**63


def test_node_state_follows_epochs_and_sequences():
    s = NodeKVState()
    assert s.apply(batch(stored=[1, 2, 3])) == "accepted" and s.blocks == {1, 2, 3}
    assert s.apply(batch(seq=2, removed=[2])) == "accepted" and s.blocks == {1, 3}
    assert s.apply(batch(seq=2, stored=[9])) == "stale" and 9 not in s.blocks          # a replayed sequence
    assert s.apply(batch(seq=4, stored=[4])) == "reset" and s.blocks == {4}            # seq 3 was lost
    assert s.apply(batch(seq=5, cleared=True, stored=[5])) == "reset" and s.blocks == {5}
    assert s.apply(batch("e2", started=2.0, seq=1, stored=[6])) == "reset" and s.blocks == {6}   # restarted
    assert s.apply(batch("e1", started=1.0, seq=9, stored=[7])) == "stale" and s.blocks == {6}   # the dead one
    assert s.leading_blocks([6, 1]) == 1 and s.leading_blocks([1, 6]) == 0


def test_subscriber_drops_forged_messages_and_keeps_the_node_state():
    metrics, node = ProxyMetrics(), Node("http://n", "decode")
    sub = EventSubscriber(TOKEN, metrics)
    assert sub.handle(node, encode_batch(KEY, batch(stored=[11, 12])), "") == "accepted"
    forged = encode_batch(events_key(OTHER), batch("evil", started=99.0, cleared=True, stored=[666]))
    assert sub.handle(node, forged, "") == "forged"
    assert sub.handle(node, [b"garbage"], "") == "forged"
    assert node.kv.blocks == {11, 12} and node.kv.epoch == "e1"
    assert metrics.kv_events.labels("forged")._value.get() == 2
    assert metrics.node_cached_blocks.labels("decode", "http://n")._value.get() == 2
    sub._ctx.term()


def test_publisher_to_subscriber_over_zmq_and_a_new_endpoint_forgets():
    async def run():
        metrics, node = ProxyMetrics(), Node("http://n", "prefill")
        sub = EventSubscriber(TOKEN, metrics)
        pub = KVEventPublisher(TOKEN)
        forger = zmq.Context.instance().socket(zmq.PUB)        # past CURVE (the cluster's key pair), another MAC key
        kv_curve.serve(forger, kv_curve.server_keys(TOKEN))
        forger.bind("tcp://127.0.0.1:*")
        try:
            sub.watch(node, pub.endpoint)
            await _until(lambda: node.kv.epoch, "the heartbeat")
            pub.publish([("stored", 5), ("stored", 6), ("removed", 5)])
            await _until(lambda: node.kv.blocks == {public_hash(KEY, 6)}, "stored then removed")
            sub.watch(node, forger.getsockopt_string(zmq.LAST_ENDPOINT))    # e.g. a restarted node's new port
            assert node.kv.blocks == set()
            await asyncio.sleep(0.2)                       # let the SUB connect (no state depends on it)
            for _ in range(3):
                forger.send_multipart(encode_batch(events_key(OTHER), batch("x", 9e9, stored=[1])))
            await _until(lambda: metrics.kv_events.labels("forged")._value.get() >= 1, "a forged batch dropped")
            assert node.kv.blocks == set()
        finally:
            pub.close()
            forger.close()
            await sub.stop()

    asyncio.run(run())


async def _until(condition, what: str, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_engine_publishes_the_hashes_the_proxy_computes(tiny_llama, salt):
    from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig
    from pdserve.engine.core.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), cache=CacheConfig(block_size=4),
                                    kv_transfer=KVTransferConfig(kv_events_port=0, kv_auth_token=TOKEN)))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    kv_curve.connect_to(sub, kv_curve.server_keys(TOKEN))
    sub.connect(engine.kv_events_endpoint)
    try:
        assert sub.poll(5000), "no heartbeat"              # connected: what follows is not lost
        ids = list(range(5, 31))                            # 26 tokens: 6 full blocks of 4
        engine.add_request("a", ids, SamplingParams(max_tokens=1, temperature=0), cache_salt=salt)
        while engine.has_unfinished():
            engine.step()
        want = Routing(4, "f", block_size=4, events_key=KEY).block_hashes(ids, salt)
        got: list[int] = []
        deadline = time.monotonic() + 5
        while len(got) < len(want) and time.monotonic() < deadline:
            if sub.poll(100):
                got += decode_batch(KEY, sub.recv_multipart()).stored
        assert len(want) == 6 and got == list(want)
        other = Routing(4, "f", block_size=4, events_key=KEY).block_hashes(ids, "tenant-b")
        assert not set(other) & set(got)                   # another tenant's hashes never match
    finally:
        sub.close()
        engine.shutdown()
