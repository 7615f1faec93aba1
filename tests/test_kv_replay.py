"""KV-event replay (engine/kv/kv_replay.py, proxy/kv_events.py): a real publisher's PUB + ROUTER on 127.0.0.1 and the
proxy's subscriber. A subscriber that joins after the node cached blocks learns them from the replay; a request
without the cluster's key gets no answer; a reply for another socket or request is refused; live batches the replay
already holds are not applied twice, and a gap asks again."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.engine.kv import kv_replay
from pdserve.engine.kv.kv_events import EventBatch, KVEventPublisher, events_key, public_hash
from pdserve.proxy import kv_events as proxy_events
from pdserve.proxy.kv_events import EventSubscriber
from pdserve.proxy.kv_state import NodeKVState
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.nodes import Node

TOKEN = "t" * 32


async def _until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
def publisher():
    pub = KVEventPublisher(TOKEN)
    yield pub
    pub.close()


def _cache(pub: KVEventPublisher, hashes: list[int]) -> set[int]:
    """The node caches ``hashes`` (events published before anyone subscribes); their public hashes."""
    pub.publish([("stored", h) for h in hashes])
    deadline = time.monotonic() + 5
    while pub._mirror.snapshot()[1].__len__() < len(hashes):
        assert time.monotonic() < deadline, "the publisher sent its batch"
        time.sleep(0.01)
    return {public_hash(events_key(TOKEN), h) for h in hashes}


def test_a_late_subscriber_learns_what_the_node_cached_before(publisher):
    wanted = _cache(publisher, [11, 12, 13])

    async def main():
        sub, node = EventSubscriber(TOKEN, ProxyMetrics()), Node("http://n", "decode")
        try:
            sub.watch(node, publisher.endpoint, publisher.replay_endpoint)
            await _until(lambda: node.kv.blocks == wanted, 5, "the replayed blocks")
            publisher.publish([("removed", 12), ("stored", 14)])        # live events follow the replay
            later = wanted - {public_hash(events_key(TOKEN), 12)} | {public_hash(events_key(TOKEN), 14)}
            await _until(lambda: node.kv.blocks == later, 5, "the live events after the replay")
            assert node.kv.resets == 1                     # the one of watch(): nothing known of a new endpoint
        finally:
            await sub.stop()

    asyncio.run(main())


def test_without_the_key_the_node_does_not_answer(publisher, monkeypatch):
    _cache(publisher, [21])
    monkeypatch.setattr(proxy_events, "REPLAY_TIMEOUT_S", 0.3)

    async def main():
        metrics = ProxyMetrics()
        sub, node = EventSubscriber("x" * 32, metrics), Node("http://n", "decode")
        try:
            assert await sub.replay(node, publisher.endpoint, publisher.replay_endpoint) == "replay_failed"
            assert node.kv.blocks == set()
        finally:
            await sub.stop()

    asyncio.run(main())


def test_a_reply_for_another_socket_or_request_is_refused():
    key = kv_replay.replay_key(events_key(TOKEN))
    state = kv_replay.ReplayState("e", 1.0, 3, [1, 2], "tcp://127.0.0.1:7001", (b"n" * 16).hex())
    frames = kv_replay.reply_frames(key, state)
    assert kv_replay.decode_reply(key, frames, b"n" * 16, "tcp://127.0.0.1:7001").blocks == [1, 2]
    with pytest.raises(ValueError, match="another"):
        kv_replay.decode_reply(key, frames, b"n" * 16, "tcp://127.0.0.1:7002")     # relayed from another node
    with pytest.raises(ValueError, match="another"):
        kv_replay.decode_reply(key, frames, b"m" * 16, "tcp://127.0.0.1:7001")     # an old reply, replayed
    with pytest.raises(ValueError, match="MAC"):
        kv_replay.decode_reply(kv_replay.replay_key(events_key("x" * 32)), frames, b"n" * 16, "tcp://127.0.0.1:7001")
    assert kv_replay.verify_request(key, kv_replay.request_frames(key, b"n" * 16)) == b"n" * 16
    assert kv_replay.verify_request(key, [kv_replay.TOPIC, b"n" * 16, b"\0" * 32]) is None


def test_batches_the_replay_holds_are_not_applied_twice_and_a_gap_asks_again():
    state = NodeKVState()
    assert state.restore(kv_replay.ReplayState("e", 1.0, 5, [1, 2], "", "")) == "replayed"
    assert state.apply(EventBatch("e", 1.0, 4, stored=[9])) == "replayed"      # queued before the reply: in it
    assert state.apply(EventBatch("e", 1.0, 6, removed=[2])) == "accepted"
    assert state.blocks == {1} and not state.needs_replay
    assert state.apply(EventBatch("e", 1.0, 9, stored=[3])) == "reset"          # lost 7, 8
    assert state.needs_replay and state.blocks == {3}
    assert state.restore(kv_replay.ReplayState("old", 0.5, 9, [7], "", "")) == "stale"   # an older process


def test_the_mirror_is_bounded(monkeypatch):
    monkeypatch.setattr(kv_replay, "MAX_REPLAY_BLOCKS", 4)
    mirror = kv_replay.BlockMirror()
    mirror.apply(1, False, list(range(10)), [])
    assert mirror.snapshot() == (1, [6, 7, 8, 9])             # the newest kept
    mirror.apply(2, True, [20], [])
    assert mirror.snapshot() == (2, [20])
