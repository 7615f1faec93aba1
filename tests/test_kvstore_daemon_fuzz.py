"""Fuzzed frames at the KV store daemon: random bytes, truncated and oversized msgpack headers, declared
lengths larger (or smaller) than their frames, wrong types in every field of every request, mutated
valid requests. Each gets exactly one reply (an error reply for every malformed one), the daemon keeps
serving (ping), and a known object put first is intact afterwards, byte for byte, with its digest.

Before: these are new checks of existing behaviour (``KVDaemon.handle`` never raises); they pin it down
for every request kind and field, which ``test_kvstore_daemon`` covers only with random bytes and a
fixed list of cases.
"""

from __future__ import annotations

import threading

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.kvstore import protocol as P
from pdserve.kvstore.daemon import DaemonLimits, KVDaemon
from pdserve.kvstore.memory import MemoryTier

LIMITS = DaemonLimits(max_batch=8, max_object_bytes=1 << 16, max_header_bytes=4 << 10, max_shm_bytes=1 << 16,
                      max_shm_clients=2)           # an Attach the fuzzer gets right makes a small segment
KNOWN_KEY = "known-chunk:0"
KNOWN = torch.arange(256, dtype=torch.float32)
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def daemon():
    daemon = KVDaemon(MemoryTier(8 << 20), port=0, limits=LIMITS)
    stop = threading.Event()
    thread = threading.Thread(target=daemon.serve, args=(stop,), daemon=True)
    thread.start()
    yield daemon, thread
    stop.set()
    thread.join()
    daemon.close()


@pytest.fixture(scope="module")
def sock(daemon):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon[0].endpoint)
    data = KNOWN.numpy().tobytes()
    put = P.Put(id=1, objs=[P.meta_of(KNOWN_KEY, KNOWN, digest=P.digest_of(KNOWN_KEY, data))])
    assert _exchange(s, [P.ENCODER.encode(put), data]).ok
    yield s
    s.close()
    ctx.term()


def _exchange(sock, frames: list[bytes]) -> P.Reply:
    sock.send_multipart(frames)
    assert sock.poll(10_000), "the daemon did not answer"
    reply = sock.recv_multipart()
    assert len(reply) >= 1
    return P.REPLY_DECODER.decode(reply[0])


def _still_serving(sock) -> None:
    assert _exchange(sock, [P.ENCODER.encode(P.Ping(id=77))]).ok
    sock.send_multipart([P.ENCODER.encode(P.Get(id=78, keys=[KNOWN_KEY]))])
    assert sock.poll(10_000)
    header, *payload = sock.recv_multipart()
    reply = P.REPLY_DECODER.decode(header)
    assert reply.ok and reply.id == 78 and len(payload) == 1
    meta = reply.objs[0]
    assert payload[0] == KNOWN.numpy().tobytes() and P.check_digest(meta, payload[0])


# -- what the fuzzer draws from ----------------------------------------------------------------------

KEYS = st.text(alphabet="abc:/.0123456789-_", min_size=0, max_size=12).filter(lambda k: not k.startswith("known"))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(), st.text(max_size=8),
                    st.binary(max_size=8))
ANY = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=4), max_leaves=12)
DTYPES = st.sampled_from(["float32", "uint8", "bfloat16", "int64", "complex64", "", "float32\x00"])
SHAPES = st.lists(st.one_of(st.integers(-2, 64), st.integers(-2**63, 2**63 - 1)), max_size=4)


def _valid_requests() -> st.SearchStrategy:
    meta = st.builds(lambda k, d, s, n, o, g: [k, d, s, n, o, g], KEYS, DTYPES, SHAPES, st.integers(-1, 2**40),
                     st.sampled_from([P.FRAME, P.DEFERRED, 0, 4096]), st.integers(0, 2**64 - 1))
    keys = st.lists(KEYS, max_size=10)
    return st.one_of(
        st.fixed_dictionaries({"op": st.just("put"), "id": st.integers(0, 2**32), "objs": st.lists(meta, max_size=3),
                               "gen": st.integers(0, 3)}),
        st.fixed_dictionaries({"op": st.just("get"), "id": st.integers(0, 2**32), "keys": keys,
                               "gen": st.integers(0, 3)}),
        st.fixed_dictionaries({"op": st.sampled_from(["contains"]), "keys": keys}),
        st.fixed_dictionaries({"op": st.just("lookup"), "chunk_keys": keys, "num_layers": st.integers(-1, 2**20)}),
        st.fixed_dictionaries({"op": st.sampled_from(["stats", "ping", "detach"])}),
        st.fixed_dictionaries({"op": st.just("attach"), "pid": st.integers(-1, 2**31), "size": st.integers(-1, 2**40)}),
    )


@st.composite
def _mutated(draw) -> dict:
    """A request of any kind with one field (or the tag) replaced by any value, or one unknown field added."""
    request = draw(_valid_requests())
    field = draw(st.sampled_from([*request, "v", "token", "unknown"]))
    request[field] = draw(ANY)
    return request


# -- the properties ----------------------------------------------------------------------------------

@FUZZ
@given(frames=st.lists(st.binary(max_size=256), min_size=1, max_size=4))
def test_random_bytes(daemon, sock, frames):
    reply = _exchange(sock, frames)
    assert not reply.ok and reply.error
    _still_serving(sock)


@FUZZ
@given(request=_valid_requests(), cut=st.integers(0, 10_000))
def test_truncated_headers(daemon, sock, request, cut):
    header = msgspec.msgpack.encode(request)
    reply = _exchange(sock, [header[:cut % max(1, len(header))]])
    assert not reply.ok and reply.error
    _still_serving(sock)


@FUZZ
@given(request=_valid_requests(), pad=st.integers(1, 8 << 10))
def test_oversized_headers(daemon, sock, request, pad):
    request["token"] = "x" * (LIMITS.max_header_bytes + pad)
    reply = _exchange(sock, [msgspec.msgpack.encode(request)])
    assert not reply.ok and f"over {LIMITS.max_header_bytes} bytes" in reply.error
    _still_serving(sock)


@FUZZ
@given(nbytes=st.one_of(st.integers(0, 2**20), st.integers(2**20, 2**64 - 1)), sent=st.integers(0, 4096),
       numel=st.integers(0, 1024))
def test_declared_lengths_that_disagree_with_the_frame(daemon, sock, nbytes, sent, numel):
    meta = P.ObjMeta("fuzz:0", "uint8", [numel], nbytes)
    reply = _exchange(sock, [P.ENCODER.encode(P.Put(id=5, objs=[meta])), b"\x01" * sent])
    if nbytes == numel == sent and nbytes <= LIMITS.max_object_bytes:
        assert not reply.ok and "digest" in reply.error                 # the one consistent case: no digest
    else:
        assert not reply.ok and reply.error
    _still_serving(sock)


@FUZZ
@given(request=_mutated(), extra=st.lists(st.binary(max_size=64), max_size=3))
def test_wrong_types_and_mutated_fields(daemon, sock, request, extra):
    try:
        header = msgspec.msgpack.encode(request)
    except (TypeError, OverflowError, msgspec.EncodeError):
        return                                                          # not representable in msgpack
    reply = _exchange(sock, [header, *extra])
    assert reply.ok or reply.error
    _still_serving(sock)


def test_the_daemon_survived_everything(daemon, sock):
    _, thread = daemon
    assert thread.is_alive()
    _still_serving(sock)
    stats = _exchange(sock, [P.ENCODER.encode(P.Stats(id=9))]).stats
    assert stats["daemon"]["errors"] > 0
