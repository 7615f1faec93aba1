"""Only the cluster reads or writes its KV (issue 35, findings 1, 3, 4 and 5): the token, its keys, bounds.

A daemon with the cluster token refuses every operation that does not carry its wire token -- Put, Get,
Contains, Lookup, Delete, Stats, Attach, even Ping -- and the token itself never travels. Nodes refuse to
start on a shared store without it. A value someone else put in Redis or on disk cannot make a reader
allocate more than ``--kv-max-object-bytes`` (peak RSS measured in a fresh process).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis
import torch
import zmq

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures
from kvstore_fixtures import TOKEN, DaemonProcess, unique_prefix
from pdserve.engine.config import ConfigError, KVTransferConfig
from pdserve.kvstore import client_segment, codec
from pdserve.kvstore import protocol as P
from pdserve.kvstore.auth import ClusterKey, read_token_file
from pdserve.kvstore.client import DaemonClient, DaemonError
from pdserve.kvstore.session import daemon_proof, request_token
from pdserve.kvstore.zmq_context import shared_context

OPS = {"put": P.Put(objs=[P.ObjMeta("a:0", "uint8", [4], 4, digest=P.digest_of("a:0", b"abcd"))]),
       "get": P.Get(keys=["a:0"]), "contains": P.Contains(keys=["a:0"]),
       "lookup": P.Lookup(chunk_keys=["a"], num_layers=1), "delete": P.Delete(keys=["a:0"]),
       "stats": P.Stats(), "ping": P.Ping(), "attach": P.Attach(pid=os.getpid(), size=4096), "detach": P.Detach()}


@pytest.fixture(scope="module")
def token_daemon():
    proc = DaemonProcess("--kv-cpu-bytes", str(4 << 20), "--log-level", "ERROR", token=TOKEN)
    with DaemonClient(proc.url, token=TOKEN, timeout_s=20) as owner:
        owner.put([("a:0", torch.arange(4, dtype=torch.uint8))])
    yield proc
    proc.stop()


def _send(url: str, req, frames=()) -> P.Reply:
    sock = shared_context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    try:
        sock.send_multipart([P.ENCODER.encode(req), *frames])
        assert sock.poll(20_000), "no reply"
        return P.REPLY_DECODER.decode(sock.recv_multipart()[0])
    finally:
        sock.close()


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("token", ["", "wrong", TOKEN, ClusterKey(TOKEN).wire_key.hex()])
def test_every_operation_needs_a_signed_session(token_daemon, op, token):
    """Before: `pdserve serve`'s daemon had no token; Lookup/Get were a membership and content oracle, Put a
    forgery, Attach a way to pin /dev/shm. Now nothing but a request signed in a Hello'd session is served: the
    token itself, or the wire key sent as a token, opens nothing (neither ever has to cross a socket)."""
    req = OPS[op]
    req.token = token
    reply = _send(token_daemon.url, req, [b"abcd"] if op == "put" else [])
    assert not reply.ok and reply.code == P.NO_SESSION and not reply.objs and not reply.stats
    with DaemonClient(token_daemon.url, token=TOKEN, timeout_s=20) as owner:
        assert owner.ping() and torch.equal(owner.get(["a:0"])[0], torch.arange(4, dtype=torch.uint8))


def test_a_signed_request_cannot_be_replayed_or_moved(token_daemon):
    """A request a listener saw (or recorded on the network) is refused when sent again, from its own zmq
    identity (a replay) or from another (the signature names the client); a wrong signature too."""
    sock = _dealer(token_daemon.url, b"client-identity-1")
    try:
        hello = _roundtrip(sock, P.Hello(nonce=b"n" * 16, id=1))
        key = ClusterKey(TOKEN).wire_key
        assert hello.ok and hello.proof == daemon_proof(key, b"n" * 16, hello.nonce)
        stats = P.Stats(id=2, token=request_token(key, hello.nonce, b"client-identity-1", 2))
        assert _roundtrip(sock, stats).ok
        again = _roundtrip(sock, stats)
        assert not again.ok and "replay" in again.error
        bad = _roundtrip(sock, P.Stats(id=3, token=request_token(key, hello.nonce, b"client-identity-1", 4)))
        assert not bad.ok and "auth token" in bad.error
    finally:
        sock.close()
    other = _dealer(token_daemon.url, b"client-identity-2")
    try:
        _roundtrip(other, P.Hello(nonce=b"m" * 16, id=1))
        moved = _roundtrip(other, P.Stats(id=5, token=request_token(key, hello.nonce, b"client-identity-1", 5)))
        assert not moved.ok and "auth token" in moved.error
    finally:
        other.close()


def test_a_process_that_takes_the_port_gets_nothing_it_can_use(token_daemon):
    """A review's attack: the daemon dies (crash, OOM kill, restart), uid nobody binds its port, and the nodes'
    routine Stats calls handed it the wire token, which the restarted daemon accepted. Now the client asks the
    listener to prove the key first (it cannot: nothing more is sent), and what it already sent names the old
    daemon process: the restarted daemon refuses it."""
    router = shared_context().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = DaemonClient(f"tcp://127.0.0.1:{port}", token=TOKEN, timeout_s=2)
    try:
        with pytest.raises(DaemonError, match="does not hold the cluster's key"):
            _answer_hello_badly(router, client)
        assert client._counters["daemon_auth_failures"] == 1
        assert not router.poll(300), "the client sent more than its Hello"
    finally:
        client.close()
        router.close()
    with DaemonClient(token_daemon.url, token=TOKEN, timeout_s=20) as real:   # a signed request, recorded ...
        real.ping()
        recorded = P.Ping(id=99, token=request_token(ClusterKey(TOKEN).wire_key, real._daemon_nonce, real._ident, 99))
    restarted = DaemonProcess("--kv-cpu-bytes", str(1 << 20), "--log-level", "ERROR", token=TOKEN)
    try:                                                                       # ... is worth nothing elsewhere
        sock = _dealer(restarted.url, real._ident)
        reply = _roundtrip(sock, recorded)
        assert not reply.ok and reply.code == P.NO_SESSION
        _roundtrip(sock, P.Hello(nonce=b"x" * 16, id=1))
        assert not _roundtrip(sock, P.Ping(id=100, token=recorded.token)).ok
        sock.close()
    finally:
        restarted.stop()


def _answer_hello_badly(router, client: DaemonClient) -> None:
    import threading

    def impostor():
        assert router.poll(10_000)
        ident, head = router.recv_multipart()
        req = P.REQUEST_DECODER.decode(head)
        assert isinstance(req, P.Hello) and req.token == ""
        router.send_multipart([ident, P.ENCODER.encode(P.Reply(id=req.id, nonce=b"z" * 16, proof=b"\0" * 32))])

    thread = threading.Thread(target=impostor)
    thread.start()
    try:
        client.ping()
    finally:
        thread.join()


def _dealer(url: str, ident: bytes):
    sock = shared_context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, ident)
    sock.connect(url)
    return sock


def _roundtrip(sock, req) -> P.Reply:
    sock.send(P.ENCODER.encode(req))
    assert sock.poll(20_000), "no reply"
    return P.REPLY_DECODER.decode(sock.recv())


def test_keys_are_derived_apart_and_never_printed():
    key = ClusterKey(TOKEN)
    assert len({key.wire_key.hex(), key.seal_key.hex(), TOKEN}) == 3 and len(key.seal_key) == len(key.wire_key) == 32
    assert TOKEN not in repr(key) and key.seal_key.hex() not in repr(key)
    assert TOKEN not in repr(KVTransferConfig(kv_auth_token=TOKEN))
    with pytest.raises(ValueError, match="at least 16"):
        ClusterKey("short")


def test_token_file_must_be_private(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        read_token_file(path)
    os.chmod(path, 0o600)
    assert read_token_file(path) == TOKEN


@pytest.mark.parametrize("flags", [dict(role="decode", kv_store="tcp://127.0.0.1:5557"),
                                   dict(kv_redis="redis://127.0.0.1:6379/0"), dict(kv_disk_dir="/tmp/kv")])
def test_a_node_on_a_shared_store_needs_the_key(flags):
    with pytest.raises(ConfigError, match="PDSERVE_KV_AUTH_TOKEN"):
        KVTransferConfig(**flags)
    KVTransferConfig(**flags, kv_auth_token=TOKEN)
    KVTransferConfig(role="prefill", kv_store="embedded")          # memory only: this process's own key


def test_daemon_beyond_loopback_needs_a_token_or_an_explicit_opt_out():
    cmd = [sys.executable, "-m", "pdserve.kvstore", "--host", "0.0.0.0", "--port", "0", "--log-level", "WARNING"]
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_KV_AUTH_TOKEN"}
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--allow-unauthenticated" in refused.stderr
    opened = subprocess.Popen(cmd + ["--allow-unauthenticated"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert opened.stdout.readline().startswith("READY ")
    finally:
        opened.kill()
        opened.wait()
    assert "WITHOUT an auth token" in opened.stderr.read()


# -- bounded decoding -------------------------------------------------------------------------------------

_READ_PEAK = """
import resource, sys
from pdserve.kvstore.{module} import {tier}
tier = {tier}(*{args}, codec_name="lz4", max_object_bytes={limit})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
got = tier.get([{key!r}])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(got == [None], tier.stats()[tier.name]["checksum_failures"], (after - before) // 1024)
"""


def _peak_mib(module: str, tier: str, args: tuple, key: str, limit: int = 1 << 20) -> tuple[bool, int, int]:
    code = _READ_PEAK.format(module=module, tier=tier, args=repr(args), key=key, limit=limit)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    miss, failures, mib = out.stdout.split()
    return miss == "True", int(failures), int(mib)


def _bomb(key: str, claimed: int, compressed: int) -> bytes:
    """A valid lz4 object whose header claims ``claimed`` raw bytes: a few MiB in Redis, far more in memory."""
    real = codec.encode(torch.zeros(claimed, dtype=torch.uint8), "lz4", key)
    assert len(real) - codec.HEADER_BYTES <= compressed
    return real


def test_a_decompression_bomb_in_redis_is_refused_before_allocating(redis_server):
    """Before: a 2 MiB lz4 value became a 512 MiB object in the daemon (RSS +515 MiB)."""
    prefix, key = unique_prefix() + ":", "bomb:0"
    redis.Redis(port=redis_server.port).set(prefix + key, _bomb(key, 512 << 20, 4 << 20))
    miss, failures, mib = _peak_mib("redis_tier", "RedisTier", (redis_server.url, prefix), key)
    assert miss and failures == 1 and mib < 64, f"peak RSS grew {mib} MiB"


def test_a_huge_value_in_redis_is_read_only_up_to_the_limit(redis_server):
    prefix, key = unique_prefix() + ":", "huge:0"
    redis.Redis(port=redis_server.port).set(prefix + key, b"\0" * (256 << 20))
    miss, failures, mib = _peak_mib("redis_tier", "RedisTier", (redis_server.url, prefix), key)
    assert miss and failures == 1 and mib < 64, f"peak RSS grew {mib} MiB"


def test_a_huge_or_linked_file_in_the_disk_tier_is_refused_unread(tmp_path):
    from pdserve.kvstore.disk import DiskTier

    tier = DiskTier(tmp_path, 8 << 30)
    with open(tier.path_of("huge:0"), "wb") as f:
        f.truncate(2 << 30)                                  # sparse: 2 GiB to read, no disk used
    os.symlink("/etc/hostname", tier.path_of("link:0"))
    miss, failures, mib = _peak_mib("disk", "DiskTier", (str(tmp_path), 8 << 30), "huge:0")
    assert miss and failures == 1 and mib < 64, f"peak RSS grew {mib} MiB"
    assert _peak_mib("disk", "DiskTier", (str(tmp_path), 8 << 30), "link:0")[:2] == (True, 1)


def test_codec_checks_sizes_before_allocating():
    blob = bytearray(_bomb("k:0", 8 << 20, 1 << 20))
    with pytest.raises(codec.CorruptObject, match="--kv-max-object-bytes"):
        codec.decode(bytes(blob), "k:0", max_bytes=1 << 20)
    small = bytearray(codec.encode(torch.zeros(16, dtype=torch.uint8), "lz4", "k:0"))
    small[92:100] = (1 << 19).to_bytes(8, "little")            # raw length far past what 20 lz4 bytes can make
    small[12:20] = (1 << 19).to_bytes(8, "little")             # and a shape that agrees with it
    with pytest.raises(codec.CorruptObject, match="cannot expand"):
        codec.decode(bytes(small), "k:0", max_bytes=1 << 20)


def test_daemon_client_refuses_a_frame_that_does_not_hold_its_meta(token_daemon):
    with DaemonClient(token_daemon.url, token=TOKEN, timeout_s=20) as client:
        meta = P.ObjMeta("x:0", "float32", [1 << 28], 4, digest=0)   # 1 GiB claimed, 4 bytes sent
        assert client_segment.payload(client, meta, iter([zmq.Frame(b"abcd")]), None) is None
        assert client.stats()["client"]["checksum_failures"] == 1


def test_an_unsigned_request_costs_the_daemon_little():
    """A review's flood: the daemon decoded a whole header (up to 8 MiB: ~1.6M metas) before it checked the
    token -- 12 token-less messages took its RSS from 248 to 1143 MiB and an authenticated ping 7.5 s. Now only
    the envelope is decoded first (the rest skipped, nothing built), and a header is at most 2 MiB."""
    import tracemalloc

    from pdserve.kvstore.daemon import KVDaemon
    from pdserve.kvstore.memory import MemoryTier

    daemon = KVDaemon(MemoryTier(1 << 20), port=0, token=TOKEN)
    n = (daemon.limits.max_header_bytes - 64) // 5
    head = b"".join([b"\x84\xa2op\xa3put\xa1v\x04\xa2id\x01\xa4objs\xdd", n.to_bytes(4, "big"),
                     b"\x94\xa0\xa0\x90\x00" * n])                   # {"op":"put","v":4,"id":1,"objs":[[...]...]}
    assert len(head) <= daemon.limits.max_header_bytes
    tracemalloc.start()
    try:
        reply = P.REPLY_DECODER.decode(daemon.handle(b"x", [zmq.Frame(head)])[0])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        daemon.close()
    assert not reply.ok and reply.code == P.NO_SESSION
    assert peak < 4 << 20, f"an unsigned {len(head) >> 20} MiB header made the daemon allocate {peak >> 20} MiB"
