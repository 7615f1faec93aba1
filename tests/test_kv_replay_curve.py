"""CURVE on a node's KV-event sockets (engine/kv/kv_curve.py, kv_replay.py, kv_events.py, proxy/kv_events.py): real
publishers' sockets on 127.0.0.1, the proxy's subscriber, and a flooding peer in its own process.

- A peer without the token (a plain ZMQ socket, or CURVE with another token's key) sends one message of 200k empty
  frames: its handshake never succeeds, nothing reaches the replay thread (its counters stay at zero), and the
  proxy's signed replay afterwards is answered (before CURVE the message reached the thread whole).
- Such a peer cannot subscribe to the events PUB either (nor send it subscriptions); the proxy still reads it.
- A proxy with another token gets no answer, and nothing reaches the replay thread.
- Without a token (dev mode) the sockets stay plain and the replay works as before; a libzmq without CURVE is an
  error at start that names the fix.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
import zmq

from pdserve.engine.kv import kv_curve
from pdserve.engine.kv.kv_events import KVEventPublisher, events_key, public_hash
from pdserve.kvstore.auth import ClusterKey
from pdserve.proxy import kv_events as proxy_events
from pdserve.proxy.kv_events import EventSubscriber
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.nodes import Node

TOKEN, OTHER = "c" * 32, "o" * 32
FLOOD_FRAMES = 200_000
NOTHING = {"answered": 0, "unsigned": 0, "repeated": 0, "over rate": 0}

# The flooding peer: connects (as a CURVE client of `token`'s key, or plain for "-"), says how its handshake went
# (the monitor's first verdict), then sends what it has -- a DEALER one message of `frames` empty frames (to the
# replay ROUTER), an XSUB `frames` made-up subscriptions (to the PUB) -- and lingers until it is out. Once
# refused, a socket has no peer to queue for: what it sends goes nowhere.
FLOODER = r"""
import sys, zmq
from zmq.utils.monitor import recv_monitor_message
from pdserve.engine.kv import kv_curve
endpoint, token, frames, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
ctx = zmq.Context()
sock = ctx.socket(getattr(zmq, kind))
sock.setsockopt(zmq.LINGER, 2000)
if token != "-":
    kv_curve.connect_to(sock, kv_curve.server_keys(token))
monitor = sock.get_monitor_socket()
sock.connect(endpoint)
verdicts = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "succeeded", zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed",
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed", zmq.EVENT_HANDSHAKE_FAILED_AUTH: "failed",
            zmq.EVENT_DISCONNECTED: "failed"}
verdict = "none"
while verdict == "none" and monitor.poll(3000):
    verdict = verdicts.get(recv_monitor_message(monitor)["event"], "none")
print(verdict, flush=True)
messages = [[b""] * frames] if kind == "DEALER" else [[b"\x01" + i.to_bytes(8, "little")] for i in range(frames)]
for message in messages:
    try:
        sock.send_multipart(message, flags=zmq.NOBLOCK)
    except zmq.Again:
        break
monitor.close()
sock.close()
ctx.term()
"""


@pytest.fixture
def publisher():
    pub = KVEventPublisher(TOKEN)
    yield pub
    pub.close()


def _flood(endpoint: str, token: str, frames: int = FLOOD_FRAMES, kind: str = "DEALER") -> str:
    """Runs the flooding peer to its end; its handshake's verdict."""
    done = subprocess.run([sys.executable, "-c", FLOODER, endpoint, token, str(frames), kind], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _replay(token: str, pub: KVEventPublisher) -> tuple[str, Node]:
    """The proxy's replay of ``pub`` with ``token``: its outcome and the node as the proxy sees it."""
    async def main():
        sub, node = EventSubscriber(token, ProxyMetrics()), Node("http://n", "decode")
        try:
            return await sub.replay(node, pub.endpoint, pub.replay_endpoint), node
        finally:
            await sub.stop()

    return asyncio.run(main())


def _cache(pub: KVEventPublisher, hashes: list[int]) -> set[int]:
    pub.publish([("stored", h) for h in hashes])
    deadline = time.monotonic() + 5
    while len(pub._mirror.snapshot()[1]) < len(hashes):
        assert time.monotonic() < deadline, "the publisher sent its batch"
        time.sleep(0.01)
    return {public_hash(events_key(TOKEN), h) for h in hashes}


@pytest.mark.parametrize("flooder_token", ["-", OTHER], ids=["plain", "another token"])
def test_a_flood_without_the_token_never_reaches_the_replay_thread(publisher, flooder_token):
    wanted = _cache(publisher, [1, 2, 3])
    assert _flood(publisher.replay_endpoint, flooder_token) != "succeeded", "a peer without the token got in"
    outcome, node = _replay(TOKEN, publisher)
    assert outcome == "replayed" and node.kv.blocks == wanted
    assert publisher._replay.counts == {**NOTHING, "answered": 1}     # the proxy's request, and nothing else


@pytest.mark.parametrize("flooder_token", ["-", OTHER], ids=["plain", "another token"])
def test_a_peer_without_the_token_cannot_subscribe_to_the_events(publisher, flooder_token):
    assert _flood(publisher.endpoint, flooder_token, frames=10_000, kind="XSUB") != "succeeded"

    async def main():                                  # the proxy's subscriber still reads the node's heartbeats
        sub, node = EventSubscriber(TOKEN, ProxyMetrics()), Node("http://n", "decode")
        try:
            sub.watch(node, publisher.endpoint)
            deadline = time.monotonic() + 5
            while node.kv.epoch != publisher._epoch:
                assert time.monotonic() < deadline, "no heartbeat reached the proxy"
                await asyncio.sleep(0.02)
        finally:
            await sub.stop()

    asyncio.run(main())


def test_a_proxy_with_another_token_gets_no_answer(publisher, monkeypatch):
    _cache(publisher, [4])
    monkeypatch.setattr(proxy_events, "REPLAY_TIMEOUT_S", 0.3)
    outcome, node = _replay(OTHER, publisher)
    assert outcome == "replay_failed" and node.kv.blocks == set()
    assert _replay(TOKEN, publisher)[0] == "replayed"                  # the handshake's failure left it working
    assert publisher._replay.counts == {**NOTHING, "answered": 1}     # the other token's request never got in


def test_without_a_token_the_sockets_stay_plain():
    assert kv_curve.server_keys("") is None
    pub = KVEventPublisher("")
    try:
        assert _flood(pub.replay_endpoint, "-", frames=3) == "succeeded"   # as before CURVE: dev mode only
        outcome, _ = _replay("", pub)
        assert outcome == "replayed"
    finally:
        pub.close()


def test_the_server_key_follows_from_the_token_alone():
    a, b = kv_curve.server_keys(TOKEN), kv_curve.server_keys(TOKEN)
    assert a == b != kv_curve.server_keys(OTHER) and len(a.public) == len(a.secret) == 40
    key = ClusterKey(TOKEN)
    assert len({key.events_curve_key, key.wire_key, key.seal_key}) == 3


def test_a_libzmq_without_curve_is_an_error_that_names_the_fix(monkeypatch):
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(RuntimeError, match="without CURVE.*kv-events-port"):
        KVEventPublisher(TOKEN)
