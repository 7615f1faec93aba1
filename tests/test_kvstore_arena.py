"""The daemon's L1 arena (issue 40): the allocator, slots, pins, and what a daemon with an arena serves.

A reference model checks the allocator (no two live extents overlap, every byte comes back); the tier's
pins are checked against eviction (a leased slot is never evicted nor reused, a deleted leased slot keeps
its bytes until the lease ends); a daemon with an arena serves exact bytes to shm and TCP clients alike,
and writes through to a lower tier from the arena.
"""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch
from kvstore_fixtures import TOKEN, wait_for

from pdserve.kvstore import protocol as P
from pdserve.kvstore.arena import ALIGN, Arena, ArenaMap, align
from pdserve.kvstore.arena_tier import ArenaTier
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.daemon import KVDaemon
from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.tiered import TieredStore


def test_allocator_never_hands_out_overlapping_extents_and_merges_every_free():
    arena, rng, live = Arena.create(1 << 20), random.Random(0), {}
    for _ in range(3000):
        if live and (rng.random() < 0.45 or len(live) > 60):
            off = rng.choice(list(live))
            arena.free(off, live.pop(off))
            continue
        n = rng.choice([1, 63, 64, 65, 4096, 40_000, 200_000])
        off = arena.alloc(n)
        if off is None:
            assert arena.free_bytes < align(n) or len(arena._starts) > 1     # full, or fragmented
            continue
        assert off % ALIGN == 0 and off + n <= arena.size
        assert all(off + align(n) <= o or o + align(m) <= off for o, m in live.items()), "overlap"
        live[off] = n
        assert arena.free_bytes == arena.size - sum(align(m) for m in live.values())
    for off, n in live.items():
        arena.free(off, n)
    assert arena.free_bytes == arena.size and arena._starts == [0] and arena._lens == {0: arena.size}
    arena.close()


def _meta(key: str, n: int) -> P.ObjMeta:
    return P.ObjMeta(key, "uint8", [n], n)


def test_store_many_commits_a_batch_in_groups_keeps_the_last_of_a_key_and_counts_what_has_no_room(monkeypatch):
    """A TCP put's batch goes into L1 at once (one lock for its slots, one commit per group): every object that fits
    is served with its own bytes, a key put twice in one batch serves the later bytes, and one with no room (all
    else pinned) is a counted rejection, never a torn or foreign slot."""
    monkeypatch.setattr("pdserve.kvstore.arena_tier.STORE_GROUP_BYTES", 3000)     # several groups in one batch
    tier = ArenaTier(64 << 10)
    items = [(P.ObjMeta(f"k{i}:0", "uint8", [1000 + i], 1000 + i), bytes([i]) * (1000 + i)) for i in range(10)]
    items.append((P.ObjMeta("k3:0", "uint8", [7], 7), b"replace"))
    slots = tier.store_many(items)
    assert all(s is not None for s in slots) and tier.stats()["memory"]["objects"] == 10
    got = tier.get([f"k{i}:0" for i in range(10)])
    assert bytes(got[3].numpy()) == b"replace"
    assert all(bytes(got[i].numpy()) == bytes([i]) * (1000 + i) for i in range(10) if i != 3)
    pinned = tier.pin([f"k{i}:0" for i in range(10)])
    assert tier.store_many([(P.ObjMeta("big:0", "uint8", [60 << 10], 60 << 10), bytes(60 << 10))]) == [None]
    assert tier.stats()["memory"]["rejected"] == 1 and tier.contains(["big:0"]) == [False]
    tier.unpin(pinned)
    tier.close()


def test_a_leased_slot_is_never_evicted_nor_reused():
    tier = ArenaTier(4 * 4096)
    tier.put([(f"k{i}:0", torch.full((4096,), i, dtype=torch.uint8)) for i in range(4)])
    (leased,) = tier.lease(["k0:0"])                            # the oldest: eviction's first choice
    tier.put([("new:0", torch.full((4096,), 9, dtype=torch.uint8))])
    assert tier.contains(["k0:0", "k1:0", "new:0"]) == [True, False, True]     # k1 went instead
    tier.delete(["k0:0"])                                        # gone from the index, bytes kept while leased
    assert not tier.contains(["k0:0"])[0] and tier.arena.free_bytes == 0
    tier.put([(f"more{i}:0", torch.full((4096,), 7, dtype=torch.uint8)) for i in range(3)])
    assert torch.equal(tier.tensor_of(leased), torch.zeros(4096, dtype=torch.uint8)), "a leased slot was reused"
    tier.unpin([leased])
    assert tier.arena.free_bytes == 4096                         # its extent came back with the lease
    tier.close()


def test_reserve_fails_counted_when_everything_is_pinned_and_an_uncommitted_slot_is_never_served():
    tier = ArenaTier(2 * 4096)
    slot = tier.reserve(_meta("w:0", 4096))
    tier.arena.view(slot.offset, 4096)[:] = 5
    assert not tier.contains(["w:0"])[0] and tier.get(["w:0"]) == [None]       # reserved: not served
    tier.put([("a:0", torch.ones(4096, dtype=torch.uint8))])
    pinned = tier.lease(["a:0"])
    assert tier.reserve(_meta("b:0", 4096)) is None and tier.stats()["memory"]["rejected"] == 1
    tier.cancel([slot])
    assert tier.reserve(_meta("b:0", 4096)) is not None
    tier.unpin(pinned)
    tier.close()


@pytest.fixture
def arena_daemon(tmp_path):
    """A daemon whose store is L1 arena -> disk, served from a thread; yields (daemon, disk tier)."""
    disk = DiskTier(str(tmp_path), 1 << 30)
    store = TieredStore(ArenaTier(8 << 20), [disk])
    daemon = KVDaemon(store, port=0, token=TOKEN)
    stop = threading.Event()
    thread = threading.Thread(target=daemon.serve, args=(stop,))
    thread.start()
    yield daemon, disk
    stop.set()
    thread.join()
    daemon.close()
    store.close()


def test_shm_and_tcp_clients_read_exact_bytes_and_the_arena_writes_through(arena_daemon):
    daemon, disk = arena_daemon
    g = torch.Generator().manual_seed(1)
    items = [(f"obj{i}:0", torch.randn(1000 * (i + 1), generator=g).to(torch.bfloat16)) for i in range(6)]
    with DaemonClient(daemon.endpoint, token=TOKEN, shm_bytes=1 << 20, timeout_s=20) as shm, \
            DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=20) as tcp:
        shm.put(items[:3])
        tcp.put(items[3:])
        keys = [k for k, _ in items]
        for client in (shm, tcp):
            got = client.get(keys + ["missing:0"])
            assert got[-1] is None and all(torch.equal(a, b) for a, (_, b) in zip(got, items))
        stats = shm.stats()
        assert stats["client"]["arena_maps"] == 1 and stats["client"]["frame_objects"] == 0
        assert stats["daemon"]["arena_committed"] == 3
        wait_for(lambda: shm.stats()["memory"]["pinned"] == 0, what="leases and zmq sends unpinned")
    wait_for(lambda: all(disk.contains(keys)), what="write-through from the arena to disk")
    assert all(torch.equal(a, b) for a, (_, b) in zip(disk.get(keys), items))


def test_threads_sharing_one_client_and_clients_of_their_own_get_exact_bytes(arena_daemon):
    daemon, _ = arena_daemon
    errors: list[str] = []
    shared = DaemonClient(daemon.endpoint, token=TOKEN, shm_bytes=1 << 20, timeout_s=30)

    def worker(n: int) -> None:
        own = DaemonClient(daemon.endpoint, token=TOKEN, shm_bytes=1 << 20, timeout_s=30)
        try:
            for step in range(15):
                client = shared if step % 2 else own
                items = [(f"w{n}-{step}-{j}:0", torch.full((8192 + n,), n * 100 + step, dtype=torch.int32))
                         for j in range(3)]
                client.put(items)
                for got, (key, want) in zip(client.get([k for k, _ in items]), items):
                    if got is not None and not torch.equal(got, want):   # None: evicted (8 MiB arena), not wrong
                        errors.append(f"{key}: wrong bytes")
        finally:
            own.close()
    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shared.close()
    assert errors == []


def test_a_client_maps_only_the_sealed_arena_the_daemon_named():
    arena = Arena.create(1 << 16)
    try:
        amap = ArenaMap.open(os.getpid(), arena.fd, arena.size, 7, arena.inode)
        amap.write(64, torch.arange(16, dtype=torch.uint8).numpy())
        assert torch.equal(arena.view(64, 16), torch.arange(16, dtype=torch.uint8))
        amap.close()
        with pytest.raises(ValueError, match="not the daemon's"):
            ArenaMap.open(os.getpid(), arena.fd, arena.size, 7, arena.inode + 1)      # another file
        fd = os.memfd_create("unsealed")
        os.ftruncate(fd, 1 << 16)
        with pytest.raises(ValueError, match="not sealed"):
            ArenaMap.open(os.getpid(), fd, 1 << 16, 7, os.fstat(fd).st_ino)
        os.close(fd)
    finally:
        arena.close()
