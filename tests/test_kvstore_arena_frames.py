"""Frame-backed L1 slots (issue: daemon tcp >= 0.8 x raw pyzmq): a TCP put's received frames kept as they are.

The tier keeps a given buffer from ``KEEP_FRAME_FROM`` bytes as the slot's bytes (no arena extent taken), counts it
against the arena's size with everything else, evicts it like any slot (never while pinned), and ``place``s it in
the arena when a mapped client leases it. Through a real daemon: objects put over TCP are served bit-exact to a
shared-memory client (after placing), to a TCP client, and written through to disk.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading

import pytest
import torch
from kvstore_fixtures import TOKEN, wait_for

from pdserve.kvstore import protocol as P
from pdserve.kvstore.arena_tier import KEEP_FRAME_FROM, ArenaTier, _extent
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.daemon import KVDaemon
from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.tiered import TieredStore
from pdserve.proxy.cluster import terminate

N = KEEP_FRAME_FROM


def _item(key: str, n: int, fill: int) -> tuple[P.ObjMeta, memoryview]:
    return P.ObjMeta(key, "uint8", [n], n), memoryview(bytearray([fill]) * n)


def _used(tier: ArenaTier) -> int:
    return tier.arena.size - tier.arena.free_bytes + tier.stats()["memory"]["frame_bytes"]


def test_kept_buffers_are_served_bit_exact_without_an_arena_extent_and_small_ones_are_copied():
    tier = ArenaTier(8 * N)
    big, small = _item("big:0", N, 3), _item("small:0", 100, 4)
    slots = tier.store_many([big, small], keep=True)
    assert slots[0].data is not None and slots[1].data is None          # kept; copied into the arena
    assert tier.arena.free_bytes == tier.arena.size - _extent(100)
    assert tier.stats()["memory"]["frame_bytes"] == _extent(N)
    got = tier.get(["big:0", "small:0"])
    assert bytes(got[0].numpy()) == bytes([3]) * N and bytes(got[1].numpy()) == bytes([4]) * 100
    assert tier.store_many([_item("copied:0", N, 5)])[0].data is None    # not given away: always copied
    tier.close()


def test_frame_backed_slots_count_against_the_arena_size_and_are_evicted_oldest_first():
    tier = ArenaTier(4 * N)
    tier.store_many([_item(f"f{i}:0", N, i) for i in range(3)], keep=True)
    tier.put([(f"a{i}:0", torch.full((N,), 9, dtype=torch.uint8)) for i in range(2)])      # 5 objects; room for 4
    assert tier.contains(["f0:0", "f1:0", "f2:0", "a0:0", "a1:0"]) == [False, True, True, True, True]
    assert _used(tier) == 4 * N and tier.stats()["memory"]["evictions"] == 1
    assert tier.stats()["memory"]["frame_bytes"] == 2 * N
    tier.store_many([_item(f"g{i}:0", N, 7) for i in range(4)], keep=True)                 # evicts all of the above
    assert tier.keys_lru_order() == [f"g{i}:0" for i in range(4)]
    assert tier.arena.free_bytes == tier.arena.size and tier.stats()["memory"]["frame_bytes"] == 4 * N
    tier.close()


def test_a_pinned_frame_backed_slot_is_never_evicted_and_keeps_its_bytes_until_unpinned():
    tier = ArenaTier(2 * N)
    tier.store_many([_item("f:0", N, 1)], keep=True)
    (leased,) = tier.lease(["f:0"])
    tier.store_many([_item("x:0", N, 2)], keep=True)
    tier.store_many([_item("y:0", N, 3)], keep=True)            # room for one beside the pinned: x goes
    assert tier.contains(["f:0", "x:0", "y:0"]) == [True, False, True]
    tier.delete(["f:0"])                                        # gone from the index; bytes and count kept while pinned
    assert _used(tier) == 2 * N and tier.store_many([_item("z:0", N, 4)], keep=True)[0] is not None
    assert tier.contains(["y:0", "z:0"]) == [False, True]
    assert bytes(tier.bytes_of(leased)) == bytes([1]) * N
    assert tier.store_many([_item("w:0", 2 * N, 5)], keep=True) == [None]     # never fits beside the pinned one
    assert tier.stats()["memory"]["rejected"] == 1
    tier.unpin([leased])
    assert _used(tier) == N and leased.data is None             # the frame went with the last pin
    tier.close()


def test_place_copies_a_frame_backed_slot_into_the_arena_once_in_the_room_its_frame_took():
    tier = ArenaTier(3 * N)
    tier.store_many([_item("f:0", N, 6), _item("g:0", N, 8)], keep=True)
    (slot,) = tier.lease(["f:0"])
    assert tier.place(slot) and slot.data is None and 0 <= slot.offset < tier.arena.size
    assert bytes(tier.arena.buf[slot.offset:slot.offset + N]) == bytes([6]) * N
    assert tier.stats()["memory"]["frame_bytes"] == N and _used(tier) == 2 * N
    assert tier.place(slot)                                     # already in the arena: nothing to do
    tier.unpin([slot])
    pinned = tier.lease(["f:0", "g:0"])
    tier.store_many([_item("h:0", N, 9)], keep=True)
    pinned += tier.lease(["h:0"])                               # the arena's size is used up, all of it pinned:
    assert tier.place(pinned[1]) and tier.stats()["memory"]["evictions"] == 0   # g's frame gives g its room
    tier.unpin(pinned)
    tier.close()


def test_place_fails_without_an_extent_long_enough_and_the_slot_keeps_its_frame():
    tier = ArenaTier(8 * N)
    tier.put([(f"a{i}:0", torch.full((N,), i, dtype=torch.uint8)) for i in range(8)])
    tier.delete(["a1:0", "a3:0"])                               # two holes of N, not next to each other
    tier.store_many([_item("f:0", 2 * N, 8)], keep=True)
    pinned = tier.lease([f"a{i}:0" for i in (0, 2, 4, 5, 6, 7)] + ["f:0"])
    assert not tier.place(pinned[-1]) and pinned[-1].data is not None
    assert bytes(tier.tensor_of(pinned[-1]).numpy()) == bytes([8]) * 2 * N
    assert _used(tier) == 8 * N and tier.stats()["memory"]["frame_bytes"] == 2 * N
    tier.unpin(pinned)
    tier.close()


@pytest.fixture
def frame_daemon(tmp_path):
    disk = DiskTier(str(tmp_path), 1 << 30)
    store = TieredStore(ArenaTier(16 << 20), [disk])
    daemon = KVDaemon(store, port=0, token=TOKEN)
    stop = threading.Event()
    thread = threading.Thread(target=daemon.serve, args=(stop,))
    thread.start()
    yield daemon, disk
    stop.set()
    thread.join()
    daemon.close()
    store.close()


def test_objects_put_over_tcp_are_served_bit_exact_over_shm_tcp_and_from_disk(frame_daemon):
    daemon, disk = frame_daemon
    g = torch.Generator().manual_seed(2)
    items = [(f"obj{i}:0", torch.randn(300_000 + 64 * i, generator=g).to(torch.bfloat16)) for i in range(5)]
    keys = [k for k, _ in items]
    with DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=20) as tcp, \
            DaemonClient(daemon.endpoint, token=TOKEN, shm_bytes=1 << 20, timeout_s=20) as shm:
        tcp.put(items)
        assert tcp.stats()["memory"]["frame_bytes"] == sum(_extent(t.nbytes) for _, t in items)
        assert all(torch.equal(a, b) for a, (_, b) in zip(tcp.get(keys), items))
        got = shm.get(keys)
        assert all(torch.equal(a, b) for a, (_, b) in zip(got, items))
        stats = shm.stats()
        assert stats["client"]["frame_objects"] == 0 and stats["memory"]["frame_bytes"] == 0   # placed in the arena
        assert all(torch.equal(a, b) for a, (_, b) in zip(tcp.get(keys), items))
        wait_for(lambda: tcp.stats()["memory"]["pinned"] == 0, what="leases and zmq sends unpinned")
    wait_for(lambda: all(disk.contains(keys)), what="write-through of frame-backed slots to disk")
    assert all(torch.equal(a, b) for a, (_, b) in zip(disk.get(keys), items))


def test_accounting_over_random_kept_copied_placed_pinned_and_deleted_objects_is_the_sum_of_the_live_ones():
    """Once every pin is gone: the arena's free bytes are its size less the live arena slots' extents, the frame
    bytes are the live frame-backed slots' extents, and every live object still has its own bytes."""
    tier, rng, held = ArenaTier(1 << 20), random.Random(11), []
    for step in range(400):
        items = [_item(f"k{rng.randrange(30)}:0", n, step % 251)
                 for n in (rng.choice([1, 4000, N, N + 1, 3 * N, 300_000]) for _ in range(rng.randrange(1, 6)))]
        slots = tier.store_many(items, pin=rng.random() < 0.2, keep=rng.random() < 0.7)
        held += [[s] for s in slots if s is not None and s.pins]
        if rng.random() < 0.3:
            leased = [s for s in tier.lease([f"k{rng.randrange(30)}:0" for _ in range(3)]) if s is not None]
            for slot in leased:
                if rng.random() < 0.5:
                    tier.place(slot)
            held.append(leased)
        if rng.random() < 0.2:
            tier.delete([f"k{rng.randrange(30)}:0"])
        if held and rng.random() < 0.5:
            tier.unpin(held.pop(0))
        assert _used(tier) <= tier.arena.size
    for slots in held:
        tier.unpin(slots)
    live = list(tier._index.values())
    in_arena = [s for s in live if s.data is None]
    assert tier.arena.free_bytes == tier.arena.size - sum(_extent(s.nbytes) for s in in_arena)
    assert tier.stats()["memory"]["frame_bytes"] == sum(_extent(s.nbytes) for s in live if s.data is not None)
    assert tier.stats()["memory"]["pinned"] == 0 and tier._pinned_bytes == 0
    for slot, got in zip(live, tier.get([s.key for s in live])):
        assert got.numel() == slot.nbytes and len(set(got.tolist())) == 1
    tier.close()


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
signal.pause()
"""


def test_frame_backed_objects_sent_to_a_stalled_reader_pin_nothing_and_are_never_copied():
    """A TCP get sends a frame-backed object as the frame it came in (zmq counts references to it): nothing pinned,
    nothing copied past the send budget, and L1 can still evict it for a new put while the reader holds it. Before:
    each was pinned until sent (up to the budget, a quarter of the arena) and the rest of every reply was copied."""
    store = TieredStore(ArenaTier(8 << 20))
    daemon = KVDaemon(store, port=0)
    stop = threading.Event()
    thread = threading.Thread(target=daemon.serve, args=(stop,))
    thread.start()
    keys = [f"big{i}:0" for i in range(6)]
    try:
        with DaemonClient(daemon.endpoint, timeout_s=20) as client:
            client.put([(k, torch.full((1 << 20,), i, dtype=torch.uint8)) for i, k in enumerate(keys)])
            proc = subprocess.Popen([sys.executable, "-c", STALLED_READER, daemon.endpoint, "8", *keys],
                                    stdout=subprocess.PIPE, text=True)
            try:
                assert proc.stdout.readline().strip() == "SENT"
                wait_for(lambda: store.stats()["memory"]["hits"] >= 48, 20, "the stalled reader's gets were served")
                wait_for(lambda: store.stats()["memory"]["pinned"] == 0, 20, "the last get's pins gone")   # (a get
                assert daemon._sending_bytes == 0           # counts its hits when it pins, before it unpins)
                assert daemon._counters["sends_copied"] == 0
                want = torch.arange(3 << 20, dtype=torch.int32).view(torch.uint8)[: 5 << 20]
                client.put([("after:0", want)])
                assert torch.equal(client.get(["after:0"])[0], want)
                assert store.stats()["memory"]["rejected"] == 0
            finally:
                terminate(proc)
    finally:
        stop.set()
        thread.join()
        daemon.close()
        store.close()
