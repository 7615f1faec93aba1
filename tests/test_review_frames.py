"""Hostile review of frame-backed L1 slots (merge eb919de: a TCP put's frames kept as the objects' bytes).

Findings, each failing on eb919de:
  * ``place`` (a shared-memory Lease of a frame-backed object) asked for a new arena extent while the object's own
    frame was still counted: in a full L1 -- a cache's steady state -- every such lease evicted another object
    (with no lower tier: lost; four 1 MiB objects in a 4 MiB L1, a shared-memory get of the first made the second
    a miss), although placing only moves bytes from the frame to the arena (the frame goes right after). With the
    rest of L1 pinned the place failed and the object went to the mapped client as a TCP frame instead.
  * ``store_many(keep=True)``: a copy that raised "cancelled" the group's frame-backed slots as arena extents
    (``Arena.free(-1, n)``): the allocator took offset -1 as free space and the frame bytes stayed counted for good;
    and a kept buffer whose length is not its meta's was kept (served with the wrong length, counted as the meta's).
    Not reachable from the daemon, which checks frame lengths first.
  * Room for an arena extent in a fragmented arena (a Reserve, a place) was made by evicting the oldest unpinned
    objects, frame-backed ones too -- which hold no extent: they went for nothing.
  * A daemon with a plain L1 (``--no-kv-shm-arena``) kept every received frame as its object's bytes, however
    small: a frame under 8 KiB is a slice of zmq's receive buffer, so each one kept that whole buffer (20000 puts
    of 100 bytes, one per message: 2 MB in L1, the daemon's RSS +183 MiB; copied: +18 MiB). The 64 KiB threshold
    held only on the arena path; ``protocol.frame_tensor`` now copies below it too.
  * (test_kvstore_arena_frames) the stalled-reader test read ``pinned`` right after the hits it waited for, but a
    get counts its hits when it pins, before it unpins: under load it saw the last get's 6 pins.
What held up, kept as a test: objects of sizes around zmq's 8 KiB receive buffer and KEEP_FRAME_FROM put over
TCP by several clients at once, one per message and many per message, each read back bit-exact over TCP and
shared memory, and from disk after L1 evicted them.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from kvstore_fixtures import TOKEN, DaemonProcess, wait_for

from pdserve.kvstore import protocol as P
from pdserve.kvstore.arena_tier import KEEP_FRAME_FROM, ArenaTier
from pdserve.kvstore.client import DaemonClient

N = 1 << 20


def _full(i: int, n: int = N) -> torch.Tensor:
    return torch.full((n,), i, dtype=torch.uint8)


def test_a_shared_memory_lease_of_a_frame_backed_object_in_a_full_l1_evicts_nothing():
    daemon = DaemonProcess("--kv-cpu-bytes", str(4 * N), "--log-level", "WARNING", token=TOKEN)
    try:
        with DaemonClient(daemon.url, token=TOKEN, timeout_s=20) as tcp, \
                DaemonClient(daemon.url, token=TOKEN, shm_bytes=1 << 20, timeout_s=20) as shm:
            items = [(f"k{i}:0", _full(i)) for i in range(4)]          # L1 full: four frame-backed objects
            tcp.put(items)
            assert tcp.stats()["memory"]["frame_bytes"] == 4 * N
            for key, want in items:
                assert torch.equal(shm.get([key])[0], want)
            stats = shm.stats()
            assert stats["memory"]["evictions"] == 0 and stats["memory"]["frame_bytes"] == 0
            assert stats["client"]["frame_objects"] == 0                # each one placed, none sent as a frame
            assert tcp.contains([k for k, _ in items]) == [True] * 4
    finally:
        daemon.stop()


def _meta(key: str, n: int) -> P.ObjMeta:
    return P.ObjMeta(key, "uint8", [n], n)


def test_a_failed_store_many_with_kept_buffers_leaves_the_arena_and_frame_count_as_they_were():
    tier = ArenaTier(8 * KEEP_FRAME_FROM)
    kept = (_meta("kept:0", KEEP_FRAME_FROM), memoryview(bytearray(KEEP_FRAME_FROM)))
    short = (_meta("short:0", 1000), memoryview(bytearray(500)))        # not its meta's bytes: the copy raises
    with pytest.raises(ValueError):
        tier.store_many([kept, short], keep=True)
    assert tier.arena.free_bytes == tier.arena.size and tier.stats()["memory"]["frame_bytes"] == 0
    assert tier.arena.alloc(tier.arena.size) == 0                       # the allocator is whole: no extent at -1
    tier.close()


def test_a_kept_buffer_that_is_not_its_metas_length_is_refused():
    tier = ArenaTier(8 * KEEP_FRAME_FROM)
    with pytest.raises(ValueError):
        tier.store_many([(_meta("long:0", KEEP_FRAME_FROM), memoryview(bytearray(3 * KEEP_FRAME_FROM)))], keep=True)
    assert tier.contains(["long:0"]) == [False] and tier.stats()["memory"]["frame_bytes"] == 0
    tier.close()


SIZES = [8 << 10, (8 << 10) + 1, KEEP_FRAME_FROM - 1, KEEP_FRAME_FROM, KEEP_FRAME_FROM + 1, 100_000, 128 << 10]


def _object(writer: int, i: int, n: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(writer * 1000 + i).integers(0, 256, n, dtype=np.uint8))


def _write(url: str, writer: int, out: dict, errors: list) -> None:
    try:
        with DaemonClient(url, token=TOKEN, timeout_s=30) as client:
            items = [(f"w{writer}o{i}:0", _object(writer, i, n)) for i, n in enumerate(SIZES * 3)]
            half = len(items) // 2
            client.put(items[:half])                                    # many objects in one message
            for item in items[half:]:
                client.put([item])                                      # one per message
            out.update(items)
    except Exception as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def test_objects_around_the_keep_threshold_from_concurrent_writers_read_back_bit_exact_everywhere(tmp_path):
    daemon = DaemonProcess("--kv-cpu-bytes", str(8 << 20), "--kv-disk-dir", str(tmp_path), "--log-level", "WARNING",
                           token=TOKEN)
    try:
        written, errors = {}, []
        threads = [threading.Thread(target=_write, args=(daemon.url, w, written, errors)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        keys = sorted(written)
        with DaemonClient(daemon.url, token=TOKEN, timeout_s=30) as tcp, \
                DaemonClient(daemon.url, token=TOKEN, shm_bytes=4 << 20, timeout_s=30) as shm:
            for got in (tcp.get(keys), shm.get(keys), tcp.get(keys)):
                assert [k for k, t in zip(keys, got) if not torch.equal(t, written[k])] == []
            wait_for(lambda: tcp.stats()["writethrough"]["queued_objects"] == 0, 20, "write-through to disk")
            tcp.put([(f"evictor{i}:0", _full(i)) for i in range(8)])    # L1 is 8 MiB: the objects above go
            assert tcp.stats()["memory"]["objects"] == 8
            got = shm.get(keys)                                         # from disk, back into L1
            assert [k for k, t in zip(keys, got) if not torch.equal(t, written[k])] == []
    finally:
        daemon.stop()


def test_room_for_an_arena_extent_in_a_fragmented_arena_is_not_made_by_evicting_frame_backed_objects():
    """Placing an object that fits L1's size but no free extent evicts arena slots until one is long enough: a
    frame-backed object, which holds no extent, must not go for nothing."""
    tier, half = ArenaTier(4 * N), N // 2
    tier.put([(f"a{i}:0", _full(i, half)) for i in range(8)])         # the arena full of N/2 slots
    tier.delete(["a1:0", "a3:0", "a5:0"])                               # three N/2 holes, none next to another
    tier.store_many([(_meta("g:0", half), memoryview(bytearray(half))),
                     (_meta("f:0", N), memoryview(bytearray(N)))], keep=True)
    tier.get([f"a{i}:0" for i in (0, 2, 4, 6, 7)])                    # LRU now: g, f, a0, a2, ...
    (slot,) = tier.lease(["f:0"])
    assert tier.place(slot)
    assert tier.contains(["g:0", "a0:0"]) == [True, False]              # a0 went (its extent joins a1's hole)
    assert tier.stats()["memory"]["evictions"] == 1
    tier.unpin([slot])
    tier.close()


def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) >> 10


def test_small_objects_put_over_tcp_into_a_plain_l1_do_not_each_keep_a_zmq_receive_buffer():
    """A frame that fits in zmq's 8 KiB receive buffer is a slice of it (zmq counts references to the buffer):
    L1 keeping it kept the whole buffer. One 100-byte object per put held ~9 KiB (20000 puts: 2 MB in L1, the
    daemon's RSS +183 MiB)."""
    daemon = DaemonProcess("--kv-cpu-bytes", str(64 << 20), "--no-kv-shm-arena", "--log-level", "WARNING",
                           token=TOKEN)
    try:
        with DaemonClient(daemon.url, token=TOKEN, timeout_s=20) as client:
            small = torch.arange(100, dtype=torch.uint8)
            client.put([("warm:0", small)])
            before = _rss_mib(daemon.proc.pid)
            for i in range(4000):                                      # one per message: one receive each
                client.put([(f"s{i}:0", small)])
            assert client.stats()["memory"]["bytes"] == 4001 * 100
            assert _rss_mib(daemon.proc.pid) - before < 16             # kept buffers: ~36 MiB; copies: < 2 MiB
            assert torch.equal(client.get(["s3999:0"])[0], small)
    finally:
        daemon.stop()
