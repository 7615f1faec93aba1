"""Wire integrity (issue 9, bug 3): every payload carries xxh3_64(key, bytes).

The daemon refuses a Put whose bytes do not match (error naming the key, nothing of the
batch stored); the client turns a Get whose bytes do not match into a miss, counted
under ``stats()["client"]["checksum_failures"]`` and logged at WARNING.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import zmq

from pdserve.kvstore import protocol as P
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.daemon import KVDaemon
from pdserve.kvstore.memory import MemoryTier


class CorruptingDaemon(KVDaemon):
    """Flips one byte of the first payload of every Get reply, after the digest was taken
    (what a reader sees when another request overwrote its region)."""

    def _get(self, req, ident, frames):
        reply, payload = super()._get(req, ident, frames)
        if payload:
            payload[0] = payload[0].copy()
            payload[0][0] ^= 1
        elif req.gen and any(reply.objs):
            self._segments.get(ident, req.gen).buf[0] ^= 1
        return reply, payload


@pytest.fixture
def served():
    daemons = []

    def start(cls=KVDaemon) -> KVDaemon:
        daemon = cls(MemoryTier(16 << 20), port=0)
        stop = threading.Event()
        thread = threading.Thread(target=daemon.serve, args=(stop,))
        thread.start()
        daemons.append((daemon, stop, thread))
        return daemon
    yield start
    for daemon, stop, thread in daemons:
        stop.set()
        thread.join()
        daemon.close()


def _raw_put(endpoint: str, objs: list[P.ObjMeta], frames: list[bytes]) -> P.Reply:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([P.ENCODER.encode(P.Put(objs=objs, id=5)), *frames])
        assert sock.poll(5000), "daemon did not answer"
        return P.REPLY_DECODER.decode(sock.recv_multipart()[0])
    finally:
        sock.close()
        ctx.term()


def test_daemon_refuses_a_put_whose_digest_does_not_match_and_stores_nothing(served):
    """Bug 3, daemon side: before the fix (no verification) both objects were stored."""
    daemon = served()
    good = P.ObjMeta("good:0", "uint8", [4], 4, digest=P.digest_of("good:0", b"abcd"))
    moved = P.ObjMeta("bad:0", "uint8", [4], 4, digest=P.digest_of("other:0", b"abcd"))   # right bytes, wrong key
    reply = _raw_put(daemon.endpoint, [good, moved], [b"abcd", b"abcd"])
    assert not reply.ok and "'bad:0'" in reply.error and "digest" in reply.error
    assert daemon.store.contains(["good:0", "bad:0"]) == [False, False]
    assert _raw_put(daemon.endpoint, [good], [b"abcd"]).ok and daemon.store.contains(["good:0"]) == [True]


@pytest.mark.parametrize("shm_bytes", [0, 1 << 20], ids=["frames", "shm"])
def test_client_turns_a_get_with_a_wrong_digest_into_a_counted_miss(served, shm_bytes, caplog):
    """Bug 3, client side: before the fix (no verification) the corrupted tensor came back as a hit."""
    daemon = served(CorruptingDaemon)
    want = torch.arange(64, dtype=torch.float32)
    with DaemonClient(daemon.endpoint, shm_bytes=shm_bytes, timeout_s=20) as client:
        client.put([("x:0", want), ("y:0", want + 1)])
        with caplog.at_level(logging.WARNING, logger="pdserve.kvstore.client"):
            got = client.get(["x:0", "y:0"])
        assert got[0] is None and torch.equal(got[1], want + 1)
        stats = client.stats()["client"]
        assert stats["checksum_failures"] == 1
        assert stats["shm_objects" if shm_bytes else "frame_objects"] == 4
    assert any("'x:0' failed its digest check" in r.getMessage() for r in caplog.records)

