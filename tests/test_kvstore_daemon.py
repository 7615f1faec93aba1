"""The daemon: malformed/oversized/unauthorised messages get error replies and the daemon
keeps answering ping; auth on non-loopback; the CLI hook; a daemon process end to end."""

from __future__ import annotations

import argparse
import threading

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures
from kvstore_fixtures import TOKEN, DaemonProcess
from pdserve.kvstore import protocol as P
from pdserve.kvstore.cli import register
from pdserve.kvstore.client import DaemonClient, DaemonError
from pdserve.kvstore.daemon import DaemonLimits, KVDaemon
from pdserve.kvstore.memory import MemoryTier


@pytest.fixture
def inproc_daemon():
    """A KVDaemon serving a MemoryTier from a thread of this process."""
    daemon = KVDaemon(MemoryTier(16 << 20), port=0, limits=DaemonLimits(max_batch=8, max_object_bytes=1 << 20))
    stop = threading.Event()
    thread = threading.Thread(target=daemon.serve, args=(stop,))
    thread.start()
    yield daemon
    stop.set()
    thread.join()
    daemon.close()


@pytest.fixture
def raw_socket(inproc_daemon):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(inproc_daemon.endpoint)
    yield sock
    sock.close()
    ctx.term()


def _exchange(sock, frames) -> P.Reply:
    sock.send_multipart(frames)
    assert sock.poll(5000), "daemon did not answer"
    reply_frames = sock.recv_multipart()
    return P.REPLY_DECODER.decode(reply_frames[0])


def _ping_ok(sock) -> bool:
    return _exchange(sock, [P.ENCODER.encode(P.Ping(id=7))]).ok


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_random_frames_get_an_error_reply_and_ping_still_works(raw_socket, frames):
    reply = _exchange(raw_socket, frames)
    assert not reply.ok and reply.error
    assert _ping_ok(raw_socket)


BAD = {
    "wrong version": (P.Ping(v=99), [], "protocol version"),
    "frame count": (P.Put(objs=[P.ObjMeta("a:0", "float32", [4], 16)]), [], "payload frames"),
    "frame size": (P.Put(objs=[P.ObjMeta("a:0", "float32", [4], 16)]), [b"x" * 15], "frame has 15 bytes"),
    "size vs shape": (P.Put(objs=[P.ObjMeta("a:0", "float32", [4], 8)]), [b"x" * 8], "does not match"),
    "oversized": (P.Put(objs=[P.ObjMeta("a:0", "uint8", [2 << 20], 2 << 20)]), [], "limit is"),
    "dtype": (P.Put(objs=[P.ObjMeta("a:0", "complex64", [1], 8)]), [b"x" * 8], "unsupported dtype"),
    "batch": (P.Get(keys=[f"k{i}:0" for i in range(9)]), [], "limit is 8"),
    "bad key": (P.Get(keys=["../x"]), [], "invalid store key"),
    "shm without attach": (P.Get(keys=["a:0"], gen=1), [], "no shm segment of generation 1"),
    "shm put without attach": (P.Put(objs=[P.ObjMeta("a:0", "uint8", [4], 4, 0)], gen=1), [], "Attach again"),
    "shm size": (P.Attach(pid=1, size=1 << 40), [], "--kv-max-shm-bytes"),
    "shm dead pid": (P.Attach(pid=1 << 30, size=4096), [], "not a live process"),
    "digest": (P.Put(objs=[P.ObjMeta("a:0", "uint8", [4], 4, digest=1)]), [b"abcd"], "digest"),
}
OLD_CLIENT = {"op": "get", "v": 1, "id": 3, "token": "", "keys": ["a:0"], "shm": True}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_requests_are_answered_with_the_reason(raw_socket, case):
    req, frames, reason = BAD[case]
    req.id = 3
    reply = _exchange(raw_socket, [P.ENCODER.encode(req), *frames])
    assert (reply.ok, reply.id) == (False, 3) and reason in reply.error
    assert _ping_ok(raw_socket)


def test_a_version_1_client_is_told_the_protocol_version(raw_socket):
    reply = _exchange(raw_socket, [msgspec.msgpack.encode(OLD_CLIENT)])
    assert not reply.ok and f"protocol version 1; this daemon speaks {P.PROTOCOL_VERSION}" in reply.error
    assert _ping_ok(raw_socket)


def test_protocol_messages_round_trip():
    for req in [P.Put(objs=[P.ObjMeta("a:0", "bfloat16", [2, 3], 12, 64, 2**64 - 1)], gen=3),
                P.Lookup(chunk_keys=["a"], num_layers=2), P.Attach(pid=4242, size=4096), P.Get(keys=["a:0"], gen=9)]:
        assert P.REQUEST_DECODER.decode(P.ENCODER.encode(req)) == req
    reply = P.Reply(objs=[None, P.ObjMeta("a:0", "float32", [1], 4, digest=7)], stats={"memory": {"hits": 1}},
                    segment=P.SegmentInfo("/dev/shm/pdserve-kv-00000000", 4096, 2), code=P.NO_SEGMENT)
    assert P.REPLY_DECODER.decode(P.ENCODER.encode(reply)) == reply
    with pytest.raises(msgspec.ValidationError):
        P.REQUEST_DECODER.decode(msgspec.msgpack.encode({"op": "put", "objs": "nope"}))


def test_non_loopback_bind_requires_a_token():
    with pytest.raises(ValueError, match="--allow-unauthenticated"):
        KVDaemon(MemoryTier(1 << 20), host="0.0.0.0", port=0)


def test_auth_token_is_checked(daemon_with_token):
    with DaemonClient(daemon_with_token.url, token=TOKEN, timeout_s=20) as good:
        good.put([("a:0", torch.ones(3))])
        assert torch.equal(good.get(["a:0"])[0], torch.ones(3))
    with DaemonClient(daemon_with_token.url, token="wrong-but-long-enough", timeout_s=20) as bad:
        with pytest.raises(DaemonError, match="does not hold the cluster's key"):
            bad.get(["a:0"])


@pytest.fixture
def daemon_with_token():
    proc = DaemonProcess("--auth-token", TOKEN, "--kv-cpu-bytes", str(1 << 20), "--log-level", "WARNING")   # a flag
    yield proc
    proc.stop()


@pytest.fixture
def segment_daemon():
    """A daemon without an arena: shm clients get per-client segments (kvstore/shm.py)."""
    proc = DaemonProcess("--no-kv-shm-arena", "--kv-cpu-bytes", str(8 << 20), "--log-level", "WARNING", token=TOKEN)
    yield proc
    proc.stop()


def test_shm_client_falls_back_to_frames_for_objects_larger_than_its_segment(segment_daemon):
    big, small = torch.arange(100_000, dtype=torch.float32), torch.ones(10)   # 400 KB vs 64 KiB segment
    with DaemonClient(segment_daemon.url, token=TOKEN, shm_bytes=64 << 10, timeout_s=20) as client:
        client.put([("shm-big:0", big), ("shm-small:0", small)])
        got = client.get(["shm-big:0", "shm-small:0", "shm-none:0"])
        assert torch.equal(got[0], big) and torch.equal(got[1], small) and got[2] is None
        stats = client.stats()
        assert stats["daemon"]["shm_clients"] >= 1
        assert stats["client"]["shm_objects"] == 2 and stats["client"]["frame_objects"] == 2


def test_cli_registers_the_kvstore_subcommand():
    parser = argparse.ArgumentParser(prog="pdserve")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["kvstore", "--port", "6000", "--kv-redis", "redis://127.0.0.1:6379/0",
                              "--kv-disk-dir", "/tmp/x", "--kv-cpu-bytes", "1024", "--auth-token", "t",
                              "--kv-max-shm-clients", "3"])
    assert (args.port, args.kv_cpu_bytes, args.kv_auth_token) == (6000, 1024, "t") and callable(args.func)
    assert args.kv_max_shm_clients == 3
