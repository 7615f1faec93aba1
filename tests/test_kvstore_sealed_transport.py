"""The daemon's TCP transport skips its xxh3 digest for sealed objects, and only for them (protocol.wire_digest).

A sealed object (seal.py) laid out for its key travels with digest 0: its keyed MAC, which every loader checks,
covers the key and every byte. So a byte flipped in transit is caught at the seal; a flipped header, another key's
frame, or any object that is not sealed for its key is still caught by the digest (a digest of 0 stands for nothing
else). Auth comes before any of it: a digestless put without a signed session is refused like any other.
"""

from __future__ import annotations

import threading

import pytest
import torch
import zmq

from kvstore_fixtures import TOKEN
from pdserve.kvstore import protocol as P
from pdserve.kvstore.auth import ClusterKey
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.config import KVStoreConfig, build_store
from pdserve.kvstore.daemon import KVDaemon
from pdserve.kvstore.seal import SEAL_BYTES, SealError, seal, sealed_for, unseal
from pdserve.kvstore.session import daemon_proof, request_token
from pdserve.kvstore.zmq_context import shared_context

SEAL_KEY = ClusterKey(TOKEN).seal_key


def _sealed(key: str, n: int = 1000) -> torch.Tensor:
    return seal(key, torch.arange(n, dtype=torch.float32), SEAL_KEY)[0]


class FlippingDaemon(KVDaemon):
    """Flips byte ``flip`` of the first payload frame of every Get reply after the digest was taken (an accident
    on the way): the daemon's L1 keeps the good bytes."""

    flip = SEAL_BYTES + 5

    def _get(self, req, ident, frames):
        reply, payload = super()._get(req, ident, frames)
        if payload:
            payload[0] = payload[0].copy()
            payload[0][self.flip] ^= 1
        return reply, payload


@pytest.fixture
def served():
    daemons = []

    def start(cls=KVDaemon, token: str = "") -> KVDaemon:
        daemon = cls(build_store(KVStoreConfig(cpu_bytes=16 << 20), arena=True), port=0, token=token)
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
        daemon.store.close()


def _exchange(sock, req, frames=()) -> tuple[P.Reply, list]:
    sock.send_multipart([P.ENCODER.encode(req), *frames])
    assert sock.poll(20_000), "daemon did not answer"
    reply = sock.recv_multipart()
    return P.REPLY_DECODER.decode(reply[0]), reply[1:]


@pytest.fixture
def raw(served):
    """A bare DEALER on a daemon without a token: (daemon, send(req, frames) -> (reply, frames))."""
    daemon = served()
    sock = shared_context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    yield daemon, lambda req, frames=(): _exchange(sock, req, frames)
    sock.close()


def _meta(key: str, obj: torch.Tensor, digest: int) -> P.ObjMeta:
    return P.meta_of(key, obj, digest=digest)


def test_sealed_for_reads_the_header_laid_out_for_that_key_only():
    obj = _sealed("x:0")
    assert sealed_for("x:0", obj.numpy()) and sealed_for("x:0", memoryview(obj.numpy()))
    assert not sealed_for("y:0", obj.numpy())                          # written for another key
    assert not sealed_for("x:0", obj.numpy()[:-4]) and not sealed_for("x:0", torch.cat([obj, obj[:4]]).numpy())
    assert not sealed_for("x:0", torch.arange(1000, dtype=torch.float32).numpy())     # a plain tensor
    assert not sealed_for("x:0", obj.numpy()[:SEAL_BYTES - 1])
    for at in (0, 4, 6, 7, 8, 32):                                     # magic, version, dtype, ndim, shape, key hash
        bad = obj.clone()
        bad[at] ^= 0x40
        assert not sealed_for("x:0", bad.numpy()), at
    body = obj.clone()
    body[SEAL_BYTES + 1] ^= 1
    assert sealed_for("x:0", body.numpy())              # the header only: the payload is the MAC's to check


def test_the_wire_digest_is_zero_for_a_sealed_object_and_xxh3_for_anything_else():
    obj, plain = _sealed("x:0"), torch.arange(10, dtype=torch.float32)
    assert P.wire_digest("x:0", obj.numpy()) == 0
    assert P.wire_digest("y:0", obj.numpy()) == P.digest_of("y:0", obj.numpy()) != 0
    assert P.wire_digest("x:0", plain.numpy()) == P.digest_of("x:0", plain.numpy()) != 0


def test_daemon_takes_a_digestless_put_only_of_an_object_sealed_for_its_key(raw):
    """Before, every put needed its xxh3 (a sealed one with digest 0 was refused); now a sealed object of its key
    goes without, and digest 0 opens nothing else: a plain tensor, another key's sealed object, or a sealed one
    whose header was hit on the way is refused, and nothing of its batch is stored."""
    daemon, send = raw
    good, plain, other = _sealed("good:0"), torch.arange(16, dtype=torch.uint8), _sealed("other:0")
    torn = good.clone()
    torn[33] ^= 1                                       # the key hash
    for key, obj in (("plain:0", plain), ("moved:0", other), ("torn:0", torn)):
        reply, _ = send(P.Put(objs=[_meta("good:0", good, 0), _meta(key, obj, 0)]), [good.numpy(), obj.numpy()])
        assert not reply.ok and "digest" in reply.error and repr(key) in reply.error, key
        assert daemon.store.contains(["good:0", key]) == [False, False]
    reply, _ = send(P.Put(objs=[_meta("good:0", good, 0), _meta("plain:0", plain, P.digest_of("plain:0", plain.numpy()))]),
                    [good.numpy(), plain.numpy()])
    assert reply.ok and daemon.store.contains(["good:0", "plain:0"]) == [True, True]
    reply, frames = send(P.Get(keys=["good:0", "plain:0"]))
    assert [m.digest for m in reply.objs] == [0, P.digest_of("plain:0", plain.numpy())]     # the same rule back
    assert bytes(frames[0]) == good.numpy().tobytes()


def test_a_byte_flipped_in_a_digestless_put_is_stored_but_fails_the_loaders_seal(raw):
    """What the daemon cannot see without a digest (a payload byte hit on the way in) the loader's MAC does."""
    daemon, send = raw
    obj = _sealed("x:0")
    hit = obj.clone()
    hit[SEAL_BYTES + 7] ^= 1
    assert send(P.Put(objs=[_meta("x:0", hit, 0)]), [hit.numpy()])[0].ok
    with DaemonClient(daemon.endpoint, timeout_s=20) as client:
        got = client.get(["x:0"])[0]
    assert got is not None and torch.equal(got, hit)
    with pytest.raises(SealError, match="MAC mismatch"):
        unseal("x:0", got, SEAL_KEY)


@pytest.mark.parametrize("flip, caught_by", [(SEAL_BYTES + 5, "seal"), (33, "digest")], ids=["payload", "header"])
def test_a_get_hit_on_the_way_is_caught_by_the_seal_or_the_digest(served, flip, caught_by):
    """A payload byte flipped in a get reply comes back (no digest) and its seal fails at the loader; a header byte
    (here the key hash) makes it not sealed for its key, so its digest of 0 fails: a counted miss at once."""
    daemon = served(type("Flip", (FlippingDaemon,), {"flip": flip}))
    obj = _sealed("x:0")
    with DaemonClient(daemon.endpoint, timeout_s=20) as client:
        client.put([("x:0", obj)])
        got = client.get(["x:0"])[0]
        failures = client.stats()["client"]["checksum_failures"]
    if caught_by == "seal":
        assert failures == 0 and got is not None
        with pytest.raises(SealError):
            unseal("x:0", got, SEAL_KEY)
    else:
        assert failures == 1 and got is None
    assert torch.equal(unseal("x:0", daemon.store.get(["x:0"])[0], SEAL_KEY)[0], torch.arange(1000, dtype=torch.float32))


def test_a_digestless_put_without_a_signed_session_is_refused(served):
    """Skipping the digest is no way around auth: the session is checked before the request is even decoded."""
    daemon = served(token=TOKEN)
    obj = _sealed("x:0")
    sock = shared_context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"digestless")
    sock.connect(daemon.endpoint)
    try:
        for token in ("", TOKEN, "0" * 64):
            reply, _ = _exchange(sock, P.Put(objs=[_meta("x:0", obj, 0)], id=1, token=token), [obj.numpy()])
            assert not reply.ok and reply.code == P.NO_SESSION
        hello, _ = _exchange(sock, P.Hello(nonce=b"n" * 16, id=1))
        key = ClusterKey(TOKEN).wire_key
        assert hello.proof == daemon_proof(key, b"n" * 16, hello.nonce)
        reply, _ = _exchange(sock, P.Put(objs=[_meta("x:0", obj, 0)], id=2, token="f" * 64), [obj.numpy()])
        assert not reply.ok and "token" in reply.error
        assert daemon.store.contains(["x:0"]) == [False]
        signed = request_token(key, hello.nonce, b"digestless", 3)
        assert _exchange(sock, P.Put(objs=[_meta("x:0", obj, 0)], id=3, token=signed), [obj.numpy()])[0].ok
        assert daemon.store.contains(["x:0"]) == [True]
    finally:
        sock.close()
