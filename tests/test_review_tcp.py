"""Hostile review of the TCP rate work (store_many, zero-copy tracked sends, digest 0 for sealed objects).

Findings, each failing on the merged tcp-rate code (b541a5b):
  * A Get or Lease naming an invalid key after valid ones pinned those slots and never unpinned them (the
    key check ran inside the pin loop): each such request pinned its hits for good, so the arena filled up with
    slots nothing could evict -- every later put a rejection.
  * A TCP put (and a Reserve) on an arena daemon stored any key, one that no get, contains or delete can ever name
    (they all check the key): the plain-L1 daemon refuses it.
  * A client that stopped reading (SIGSTOP, a frozen container, a dead link) kept every slot the daemon was
    sending it in place pinned -- no bound: the arena could be pinned full and every put refused. Now at most
    DaemonLimits.max_send_pinned_bytes (a quarter of the arena) is in flight in place; past it a reply is a copy,
    one per slot however often a get names its key.
  * The serve loop kept the last reply's zmq Frames alive until the next request: a reader that died mid-reply
    left that reply's slots pinned for as long as the daemon got no other request.
  * ``store_many``: a copy that raised left its group's slots reserved for good (not reachable from the daemon,
    which checks frame lengths first).
What held up, kept as tests: real processes putting, getting and deleting overlapping keys over TCP and shared
memory while a small arena evicts all the time -- every object read is one some put wrote, bit-exact, and its
seal holds; the arena's accounting after many batches with repeated keys, rejections, pins and deletes.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import tracemalloc

import pytest
import torch
import zmq
from kvstore_fixtures import TOKEN, wait_for

from pdserve.kvstore import protocol as P
from pdserve.kvstore.arena import align
from pdserve.kvstore.arena_tier import ArenaTier
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.config import KVStoreConfig, build_store
from pdserve.kvstore.daemon import DaemonLimits, KVDaemon
from pdserve.kvstore.zmq_context import shared_context
from pdserve.proxy.cluster import terminate


@pytest.fixture
def served():
    daemons = []

    def start(cpu_bytes: int = 1 << 20, token: str = "", limits: DaemonLimits = DaemonLimits()) -> KVDaemon:
        daemon = KVDaemon(build_store(KVStoreConfig(cpu_bytes=cpu_bytes), arena=True), port=0, token=token,
                          limits=limits)
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


@pytest.fixture
def raw(served):
    """A bare DEALER on a daemon without a token: (daemon, send(req, frames) -> (reply, frames))."""
    daemon = served()
    sock = shared_context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)

    def send(req, frames=()):
        sock.send_multipart([P.ENCODER.encode(req), *frames])
        assert sock.poll(20_000), "daemon did not answer"
        reply = sock.recv_multipart()
        return P.REPLY_DECODER.decode(reply[0]), reply[1:]
    yield daemon, send
    sock.close()


def _put(send, key: str, obj: torch.Tensor):
    data = obj.numpy()
    return send(P.Put(objs=[P.meta_of(key, obj, digest=P.digest_of(key, data))]), [data])[0]


def _pinned(daemon) -> int:
    return daemon.store.stats()["memory"]["pinned"]


@pytest.mark.parametrize("op", ["get", "lease"])
def test_a_request_naming_an_invalid_key_leaves_no_slot_pinned(raw, op):
    """Before: the valid keys' slots were pinned, then the invalid key raised -- an error reply, and pins nobody
    held any more. A 1 MiB arena with four 256 KiB objects pinned that way refused every later put."""
    daemon, send = raw
    objs = {f"k{i}:0": torch.full((256 << 10,) if i < 4 else (200 << 10,), i, dtype=torch.uint8) for i in range(5)}
    for key in list(objs)[:4]:
        assert _put(send, key, objs[key]).ok
    if op == "lease":
        gen = send(P.MapArena(pid=os.getpid()))[0].arena.gen
    for key in list(objs)[:4]:
        req = P.Get(keys=[key, "bad/key"]) if op == "get" else P.Lease(keys=[key, "bad key"], gen=gen)
        reply, _ = send(req)
        assert not reply.ok and "invalid store key" in reply.error
    assert send(P.Release())[0].ok                      # ends whatever this client leased
    wait_for(lambda: _pinned(daemon) == 0, 2, "no slot left pinned")
    assert _put(send, "k4:0", objs["k4:0"]).ok
    assert daemon.store.contains(["k4:0"]) == [True] and daemon.store.stats()["memory"]["rejected"] == 0


@pytest.mark.parametrize("op", ["put", "reserve"])
def test_an_arena_daemon_refuses_a_key_nothing_could_name_again(raw, op):
    """Before: a TCP put (or Reserve) of key "a/b" was stored in L1 -- and then no get, contains or delete could
    name it (each refuses the key): bytes held until evicted. Now it is refused as the plain-L1 daemon does."""
    daemon, send = raw
    obj = torch.arange(64, dtype=torch.uint8)
    if op == "put":
        reply = _put(send, "a/b", obj)
    else:
        gen = send(P.MapArena(pid=os.getpid()))[0].arena.gen
        reply = send(P.Reserve(objs=[P.ObjMeta("a/b", "uint8", [64], 64)], gen=gen))[0]
        if reply.ok:
            reply = send(P.Put(objs=[], gen=gen, commit=True))[0]
    assert not reply.ok and "invalid store key" in reply.error
    assert daemon.store.l1.keys_lru_order() == [] and daemon.store.stats()["memory"]["objects"] == 0


def test_a_batch_whose_buffer_is_not_its_metas_bytes_keeps_no_slot():
    """Before: a copy that raised (a buffer shorter than its meta says) left its group's slots reserved for good --
    never committed, never cancelled: arena bytes gone. The daemon checks every frame's length first, so this
    is the tier's own contract (``store_many`` is public: promotions and in-process callers use it)."""
    tier = ArenaTier(64 << 10)
    items = [(P.ObjMeta("a:0", "uint8", [1000], 1000), bytes(1000)),
             (P.ObjMeta("b:0", "uint8", [1000], 1000), bytes(10))]             # 10 bytes for 1000
    with pytest.raises(ValueError):
        tier.store_many(items)
    assert tier.arena.free_bytes == tier.arena.size and tier.contains(["a:0", "b:0"]) == [False, False]
    tier.close()


def test_arena_accounting_after_many_batches_is_the_sum_of_the_live_objects(monkeypatch):
    """Batches with repeated keys, objects with no room, pins held across batches, deletes, evictions: once every
    pin is gone the arena's free bytes are its size less the live objects' extents, and the counters agree."""
    monkeypatch.setattr("pdserve.kvstore.arena_tier.STORE_GROUP_BYTES", 20_000)
    tier, rng = ArenaTier(256 << 10), random.Random(7)
    held = []
    for step in range(300):
        items = [(P.ObjMeta(f"k{rng.randrange(40)}:0", "uint8", [n], n), bytes([step % 251]) * n)
                 for n in (rng.choice([0, 1, 63, 64, 65, 4000, 30_000, 300_000]) for _ in range(rng.randrange(1, 12)))]
        pin = rng.random() < 0.2                # as for a write-through: pinned until the lower tiers have it
        slots = tier.store_many(items, pin=pin)
        if pin:
            held.append([s for s in slots if s is not None])
        if rng.random() < 0.3:
            held.append([s for s in tier.pin([f"k{rng.randrange(40)}:0" for _ in range(3)]) if s is not None])
        if rng.random() < 0.2:
            tier.delete([f"k{rng.randrange(40)}:0"])
        if held and rng.random() < 0.4:
            tier.unpin(held.pop(0))
    for slots in held:
        tier.unpin(slots)
    live = list(tier._index.values())
    stats = tier.stats()["memory"]
    assert tier.arena.free_bytes == tier.arena.size - sum(align(max(s.nbytes, 1)) for s in live)
    assert stats["objects"] == len(live) and stats["bytes"] == sum(s.nbytes for s in live)
    assert stats["pinned"] == 0 and tier._pinned_bytes == 0
    for slot, got in zip(live, tier.get([s.key for s in live])):
        assert got.numel() == slot.nbytes
    tier.close()


WORKER = """
import os, random, sys, zlib, torch
from pdserve.kvstore.auth import ClusterKey
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.seal import seal, unseal
url, token, me, shm = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
seal_key, rng = ClusterKey(token).seal_key, random.Random(me)
SIZES = [1000, 9000, 40_000, 300_000, 1_500_000]         # int32 elements: 4 KB .. 6 MB (tracked from 32 KiB)

def body(key, writer, version):
    n = SIZES[zlib.crc32(f'{key}/{writer}/{version}'.encode()) % len(SIZES)]
    return torch.arange(n, dtype=torch.int32) * 7 + writer * 1_000_003 + version

def check(key, got):
    payload, _ = unseal(key, got, seal_key)              # raises on a torn, foreign or stale-layout object
    writer, version = int(payload[-2]), int(payload[-1])
    want = body(key, writer, version)
    assert payload.numel() == want.numel() + 2 and torch.equal(payload[:-2], want), (key, writer, version)

seen = 0
with DaemonClient(url, token=token, shm_bytes=shm, timeout_s=60) as client:
    for step in range(60):
        keys = [f"shared{rng.randrange(12)}:{rng.randrange(2)}" for _ in range(rng.randrange(1, 5))]
        op = rng.random()
        if op < 0.45:
            client.put([(k, seal(k, torch.cat([body(k, me, step), torch.tensor([me, step], dtype=torch.int32)]),
                                 seal_key)[0]) for k in keys])
        elif op < 0.9:
            for key, got in zip(keys, client.get(keys)):
                if got is not None:
                    check(key, got)
                    seen += 1
        else:
            client.delete(keys[:1])
    counters = client.stats()["client"]
    assert counters["checksum_failures"] == 0 and counters["timeouts"] == 0, counters
print("OK", seen, flush=True)
"""


def test_processes_over_tcp_and_shm_on_overlapping_keys_read_only_what_was_put(served):
    """Six processes (three over TCP frames, three through the arena) put sealed objects of 4 KB to 6 MB under
    twelve shared keys, get and delete them, against a 24 MiB arena that evicts all the time: large gets go out
    in place (tracked) while other clients overwrite, delete and evict the same keys. Every object a get returns
    unseals under its key and is bit-exact one some put wrote."""
    daemon = served(cpu_bytes=24 << 20, token=TOKEN)
    kids = [subprocess.Popen([sys.executable, "-c", WORKER, daemon.endpoint, TOKEN, str(n), str((1 << 20) * (n % 2))],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(6)]
    try:
        outs = [kid.communicate(timeout=240) for kid in kids]
    finally:
        for kid in kids:
            terminate(kid)
    assert all(out.startswith("OK") for out, _ in outs), [err[-3000:] for _, err in outs]
    assert sum(int(out.split()[1]) for out, _ in outs) > 0        # some gets hit
    stats = daemon.store.stats()
    assert stats["memory"]["evictions"] > 0 and daemon._counters["checksum_failures"] == 0
    wait_for(lambda: _pinned(daemon) == 0, 10, "every send and lease unpinned")


STALLED_READER = """
import signal, sys, zmq
from pdserve.kvstore import protocol as P
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.RCVHWM, 1)
sock.setsockopt(zmq.RCVBUF, 4096)
sock.connect(sys.argv[1])
for i in range(int(sys.argv[2])):
    sock.send_multipart([P.ENCODER.encode(P.Get(keys=sys.argv[3:], id=i + 1))])
print("SENT", flush=True)
signal.pause()                    # never reads: a stopped process, a frozen container, a partitioned host
"""


def test_a_reader_that_stops_reading_cannot_pin_the_arena_full(served):
    """Big TCP get replies go out of the arena in place, pinned until zmq has sent them. Before: a client that asked
    and then stopped reading (SIGSTOP, a frozen container, a dead link without a reset) kept every slot it was
    being sent pinned for as long as it stayed stopped -- here 6 of an 8 MiB arena -- so no later put found room.
    Now slots in flight are bounded (DaemonLimits.max_send_pinned_bytes): beyond that a reply is a copy."""
    daemon = served(cpu_bytes=8 << 20)
    keys = [f"big{i}:0" for i in range(6)]
    with DaemonClient(daemon.endpoint, timeout_s=20, shm_bytes=1 << 20) as client:     # arena slots (test_kvstore_
        client.put([(k, torch.full((1 << 20,), i, dtype=torch.uint8)) for i, k in enumerate(keys)])   # arena_frames:
        #                                                               a TCP put's frames, sent as themselves)
        proc = subprocess.Popen([sys.executable, "-c", STALLED_READER, daemon.endpoint, "8", *keys],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "SENT"
            wait_for(lambda: daemon.store.stats()["memory"]["hits"] >= 48, 20,
                     "the stalled reader's gets were served")
            want = torch.arange(3 << 20, dtype=torch.int32).view(torch.uint8)[: 5 << 20]
            client.put([("after:0", want)])
            got = client.get(["after:0"])[0]
            assert got is not None and torch.equal(got, want)
            assert daemon.store.stats()["memory"]["rejected"] == 0
        finally:
            terminate(proc)
    wait_for(lambda: _pinned(daemon) == 0, 10, "the dead reader's sends unpinned")


def test_a_reply_sent_as_a_copy_copies_each_slot_once(served):
    """Past the in-flight budget a reply goes as copies: one per slot, however often the get names its key (else a
    get naming one big key a thousand times would make the daemon allocate a thousand copies)."""
    daemon = served(cpu_bytes=4 << 20, limits=DaemonLimits(max_send_pinned_bytes=0))
    want = torch.arange(64 << 10, dtype=torch.int32)                  # 256 KiB
    with DaemonClient(daemon.endpoint, timeout_s=20, shm_bytes=1 << 20) as client:
        client.put([("big:0", want)])                     # into an arena slot (a TCP put's frame would be sent as itself)
    sock = shared_context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    tracemalloc.start()
    try:
        sock.send_multipart([P.ENCODER.encode(P.Get(keys=["big:0"] * 400, id=1))])     # one 100 MiB reply
        assert sock.poll(20_000)
        frames = sock.recv_multipart(copy=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        sock.close()
    assert len(frames) == 401 and all(f.bytes == want.numpy().tobytes() for f in frames[1:3])
    assert daemon._counters["sends_copied"] == 1 and _pinned(daemon) == 0
    assert peak < 20 << 20, peak


def test_slots_sent_in_place_to_a_reader_that_dies_mid_reply_are_unpinned(served):
    """With room in the budget a stalled reader's replies stay in place, pinned; once it is killed its connection
    drops, zmq lets go of what it queued for it, and every slot comes back. Before: the serve loop kept its last
    reply's zmq Frames in a local until the next request was handled, and the last reply queued for the dead reader
    stayed pinned (6 MiB of an 8 MiB arena here) for as long as the daemon got no other request."""
    daemon = served(cpu_bytes=8 << 20, limits=DaemonLimits(max_send_pinned_bytes=1 << 30))
    keys = [f"big{i}:0" for i in range(6)]
    with DaemonClient(daemon.endpoint, timeout_s=20, shm_bytes=1 << 20) as client:      # into arena slots
        client.put([(k, torch.full((1 << 20,), i, dtype=torch.uint8)) for i, k in enumerate(keys)])
    proc = subprocess.Popen([sys.executable, "-c", STALLED_READER, daemon.endpoint, "8", *keys],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "SENT"
        wait_for(lambda: daemon.store.stats()["memory"]["hits"] >= 48, 20, "the stalled reader's gets were served")
        assert _pinned(daemon) == 6 and daemon._counters["sends_copied"] == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)
    wait_for(lambda: _pinned(daemon) == 0, 10, "the dead reader's sends unpinned")
    assert daemon._sending_bytes == 0


def test_a_reply_already_received_pins_nothing_while_the_next_request_runs(served):
    """(Held.) A get's slot is unpinned once the client has the bytes, with the daemon idle after it: a put right
    after a get of a 3 MiB object of a 4 MiB arena finds it evictable."""
    daemon = served(cpu_bytes=4 << 20)
    first, second = torch.full((3 << 20,), 1, dtype=torch.uint8), torch.full((3 << 20,), 2, dtype=torch.uint8)
    with DaemonClient(daemon.endpoint, timeout_s=20) as client:
        client.put([("first:0", first)])
        assert torch.equal(client.get(["first:0"])[0], first)
        wait_for(lambda: _pinned(daemon) == 0, 2, "the received reply's slot unpinned")
        client.put([("second:0", second)])
        assert torch.equal(client.get(["second:0"])[0], second)
    assert daemon.store.stats()["memory"]["rejected"] == 0


class SwappingDaemon(KVDaemon):
    """Answers a two-key get with the two objects' frames swapped (metas and digests untouched)."""

    def _get(self, req, ident, frames):
        reply, payload = super()._get(req, ident, frames)
        if len(payload) == 2:
            payload.reverse()
        return reply, payload


def test_a_get_answered_with_another_keys_sealed_object_is_a_counted_miss():
    """(Held.) Swap attack on a digestless reply: two sealed objects of one size, frames swapped on the way. Each
    frame's header names the other key, so it is not "sealed for" the key it came under: its digest of 0 fails, and
    the client counts two misses -- nothing reaches a loader."""
    from pdserve.kvstore.auth import ClusterKey
    from pdserve.kvstore.seal import seal
    daemon = SwappingDaemon(build_store(KVStoreConfig(cpu_bytes=4 << 20), arena=True), port=0)
    stop = threading.Event()
    thread = threading.Thread(target=daemon.serve, args=(stop,))
    thread.start()
    try:
        objs = {k: seal(k, torch.full((20_000,), i, dtype=torch.int32), ClusterKey(TOKEN).seal_key)[0]
                for i, k in enumerate(["a:0", "b:0"])}
        with DaemonClient(daemon.endpoint, timeout_s=20) as client:
            client.put(list(objs.items()))
            assert client.get(["a:0", "b:0"]) == [None, None]
            assert client.stats()["client"]["checksum_failures"] == 2
            assert [torch.equal(g, objs[k]) for k, g in zip(["a:0"], client.get(["a:0"]))] == [True]
    finally:
        stop.set()
        thread.join()
        daemon.close()
        daemon.store.close()
