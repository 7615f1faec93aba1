"""The bounded publish path (issue 38, item 5): chunks on their way to a lagging store hold ring slots, not memory.

A real store, slowed down (``SlowStore``: a ``TieredStore`` whose puts take time, or wait on a gate), behind the
real ``ChunkPublisher`` and its thread. The test thread plays the engine thread. Before the ring, every chunk of
a long prompt was gathered into memory of its own at once and queued: with a store this slow, nearly all of them
were held together. Now the chunks gathered but not yet in the store never exceed the ring's slots plus the one
the publisher thread is putting, the ring's bytes never exceed ``--kv-publish-buffer-bytes``, and everything
published loads back bit for bit (the loader checks each seal and the publisher's digests too).
"""

from __future__ import annotations

import argparse
import threading
import time

import pytest
import torch

from polling import wait_until
from pdserve.decode.loader import ChunkLoader, LoadJob
from pdserve.engine import node
from pdserve.engine.config import ConfigError, KVTransferConfig
from pdserve.engine.kv.kv_layout import KVLayout
from pdserve.kernels.publish_ring import PublishRing, RingSlot
from pdserve.kvstore.auth import process_key
from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore
from pdserve.prefill.publisher import ChunkPublisher

KEY = process_key().seal_key
L, H, D, BS, CHUNK, BLOCKS = 4, 2, 16, 16, 32, 64
CHUNK_BYTES = L * 2 * CHUNK * H * D * 4                        # float32, K and V: 32 KiB


class SlowStore(TieredStore):
    """An in-memory tiered store whose every put takes ``delay_s`` and first waits for ``gate`` (set: open)."""

    def __init__(self, delay_s: float = 0.0):
        super().__init__(MemoryTier(64 << 20))
        self.delay_s, self.gate, self.adopted = delay_s, threading.Event(), 0
        self.gate.set()

    def adopt(self, items):
        self.gate.wait()
        time.sleep(self.delay_s)
        super().adopt(items)
        self.adopted += 1


@pytest.fixture()
def slow_store():
    s = SlowStore(delay_s=0.02)
    yield s
    s.gate.set()
    s.close()


def _cache(seed: int):
    caches = KVLayout("mha", L, H, D, torch.float32).allocate(BLOCKS, BS)
    caches.buffer.copy_(torch.randn(caches.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return caches


def _slots(tokens: int, seed: int) -> torch.Tensor:
    blocks = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed))[:(tokens + BS - 1) // BS]
    pos = torch.arange(tokens)
    return blocks[pos // BS] * BS + pos % BS


def _finished(publisher, *rids: str):
    """-> the PublishResult of each of ``rids`` (one, or a tuple), once the publisher settled them all."""
    done = {}
    wait_until(lambda: done.update(publisher.finished()) or set(rids) <= set(done), 30, f"publish of {rids}")
    return done[rids[0]] if len(rids) == 1 else tuple(done[r] for r in rids)


def _load_back(store, keys, lens, slots, digests):
    """A fresh cache loaded from the store by the real loader -> (tokens loaded, the cache)."""
    caches = KVLayout("mha", L, H, D, torch.float32).allocate(BLOCKS, BS)
    loader = ChunkLoader(store, caches, 0, (2, H, D), TierHealth("t"), KEY, chunk_tokens=CHUNK)
    try:
        loader.start(LoadJob("load", keys, lens, slots[:sum(lens)], 0, sum(lens), digests))
        done = {}
        wait_until(lambda: done.update(loader.finished()) or "load" in done, 30, "load")
        return done["load"], caches
    finally:
        loader.stop()


def _rows(caches, slots):
    return caches.buffer.view(L, 2, -1, H, D)[:, :, slots].view(torch.uint8)


@pytest.mark.parametrize("slots_in_ring", [1, 2, 4])
def test_a_long_prompt_through_a_lagging_store_stays_within_the_ring(slow_store, slots_in_ring):
    chunks, bound = 24, slots_in_ring * CHUNK_BYTES
    src, slots = _cache(seed=slots_in_ring), _slots(chunks * CHUNK, seed=slots_in_ring)
    pub = ChunkPublisher(slow_store, src, 0, TierHealth("t"), KEY, chunk_tokens=CHUNK, buffer_bytes=bound)
    keys, held, in_flight = [f"long{slots_in_ring}-{i}" for i in range(chunks)], [], []
    try:
        for i, key in enumerate(keys):                             # the engine thread, one chunk per step
            assert pub.publish("r", i, key, slots[i * CHUNK:(i + 1) * CHUNK])
            held.append(i + 1 - slow_store.adopted)                # gathered, not yet in the store
            in_flight.append(pub.ring.bytes_in_flight)
        pub.close_request("r")
        result = _finished(pub, "r")
    finally:
        pub.stop()
    assert max(held) <= slots_in_ring + 1, f"chunks held at once: {held}"   # the ring + the one being put
    assert max(in_flight) <= bound and pub.ring.peak_bytes == bound         # full: the step waited for slots
    stats = pub.buffer_stats()
    assert stats["publish_buffer_waits"] > 0 and stats["publish_buffer_skips"] == 0
    assert stats["publish_buffer_bytes_in_flight"] == 0 and stats["publish_buffer_bytes"] == bound
    assert result.chunks == chunks and not result.failed
    loaded, dst = _load_back(slow_store, keys, [CHUNK] * chunks, slots, [result.digests[i] for i in range(chunks)])
    assert loaded == chunks * CHUNK
    assert torch.equal(_rows(dst, slots), _rows(src, slots))


def test_a_stuck_store_costs_one_stall_then_skips_and_what_was_skipped_is_a_miss(slow_store):
    src, slots = _cache(seed=9), _slots(6 * CHUNK, seed=9)
    pub = ChunkPublisher(slow_store, src, 0, TierHealth("t"), KEY, chunk_tokens=CHUNK, buffer_bytes=2 * CHUNK_BYTES,
                         wait_s=0.3)
    keys = [f"stuck-{i}" for i in range(6)]
    slow_store.gate.clear()                                        # the store stops answering
    try:
        for i in range(3):                                         # 0 is being put, 1 and 2 fill the ring
            assert pub.publish("a", i, keys[i], slots[i * CHUNK:(i + 1) * CHUNK])
            if i == 0:
                wait_until(lambda: pub.ring.bytes_in_flight == 0, 10, "chunk 0 sealed, its slot back")
        started = time.monotonic()
        assert not pub.publish("a", 3, keys[3], slots[3 * CHUNK:4 * CHUNK])     # waited wait_s, then skipped
        assert time.monotonic() - started >= 0.3
        started = time.monotonic()
        assert not pub.publish("b", 0, "other-0", slots[:CHUNK])               # still stuck: skipped at once
        assert time.monotonic() - started < 0.2
        slow_store.gate.set()
        pub.close_request("a")
        pub.close_request("b")
        result, other = _finished(pub, "a", "b")
        assert (result.chunks, result.failed, other.chunks, other.failed) == (3, True, 0, True)
        assert slow_store.lookup(keys, L) == 3
        loaded, dst = _load_back(slow_store, keys[:5], [CHUNK] * 5, slots, [result.digests[i] for i in range(3)])
        assert loaded == 3 * CHUNK                                 # a miss at the skipped chunk, never wrong KV
        assert torch.equal(_rows(dst, slots[:3 * CHUNK]), _rows(src, slots[:3 * CHUNK]))
        assert not _rows(dst, slots[3 * CHUNK:5 * CHUNK]).any()
        assert pub.publish("a2", 3, keys[3], slots[3 * CHUNK:4 * CHUNK])        # slots came back: publishes again
    finally:
        pub.stop()
    stats = pub.buffer_stats()
    assert (stats["publish_buffer_waits"], stats["publish_buffer_skips"]) == (1, 2)
    assert slow_store.lookup(keys, L) == 4


def test_ring_hands_slots_between_threads_under_load():
    """Many engine-side acquires against a releasing thread: never more out than slots, every byte counted back."""
    ring = PublishRing([RingSlot(i, 10) for i in range(3)], wait_s=5.0)
    out, seen, lock = [], [], threading.Lock()
    stop = threading.Event()

    def releaser():
        while not stop.is_set() or out:
            with lock:
                slot = out.pop(0) if out else None
            if slot is not None:
                time.sleep(0.0005)
                ring.release(slot)

    t = threading.Thread(target=releaser)
    t.start()
    for _ in range(400):
        slot = ring.acquire()
        assert slot is not None
        seen.append(ring.bytes_in_flight)
        with lock:
            assert slot not in out                                 # nobody else holds it
            out.append(slot)
    stop.set()
    t.join(10)
    assert max(seen) <= 30 and ring.peak_bytes <= 30 and ring.bytes_in_flight == 0 and ring.skips == 0


def test_the_flag_reaches_the_config_and_a_ring_below_one_chunk_is_refused(tmp_path):
    parser = argparse.ArgumentParser()
    node.register(parser.add_subparsers())
    args = parser.parse_args(["node", "--model", str(tmp_path), "--kv-store", "embedded",
                              "--kv-publish-buffer-bytes", "777"])
    assert node.config_from_args(args).kv_transfer.kv_publish_buffer_bytes == 777
    assert KVTransferConfig().kv_publish_buffer_bytes == 256 << 20
    with pytest.raises(ConfigError, match="--kv-publish-buffer-bytes must be >= 1, got 0"):
        KVTransferConfig(kv_publish_buffer_bytes=0)
    with pytest.raises(ValueError, match=f"--kv-publish-buffer-bytes 777 cannot hold one KV chunk of {CHUNK_BYTES}"):
        ChunkPublisher(TieredStore(MemoryTier(1 << 20)), _cache(0), 0, TierHealth("t"), KEY, chunk_tokens=CHUNK,
                       buffer_bytes=777)
