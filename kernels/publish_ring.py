"""The publish ring: a fixed set of staging slots that every chunk on its way to the store must hold.

Why: a chunk gathered out of the paged cache used to sit in a fresh device buffer (and a fresh pinned copy) until
the publisher thread got to it -- without bound whenever the store lagged (32 MiB per 256-token chunk of an 8B
Llama, outside ``--kv-cache-memory-bytes``). Now there are ``--kv-publish-buffer-bytes // chunk bytes`` slots,
made once; a chunk that finds none free waits for one (back-pressure), never allocates.

Who calls what:

    engine thread     slot = ring.acquire()      ChunkPublisher.publish, before the gather; None -> skip the chunk
                      ChunkIO.gather(slots, slot) writes the chunk into the slot, then the item is queued
    publisher thread  ring.release(slot)         ChunkPublisher._put, once the chunk is sealed (copied out of the
                                                 slot) or dropped; never while anything may still read the slot

A slot belongs to exactly one of them at a time; ``_cond`` guards the free list and the figures.

Back-pressure policy: ``acquire`` waits up to ``wait_s`` for a slot -- the prefill step slows to the store's pace
and every chunk still reaches the store (a skipped chunk would cost the decode node a recompute of the whole rest
of the prompt, exactly when the cluster is loaded). Only a ring that stays full for ``wait_s`` (a publisher stuck
on a store that does not answer) makes ``acquire`` give up: that chunk is skipped and counted, and until a slot is
released again later acquires skip at once, so a stuck store costs one stall, not one per chunk. A skipped
chunk is a store miss, never wrong KV: nothing of it is written, and the request publishes nothing after it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from pdserve.kernels.staging import SlotIndex, Staging

DEFAULT_WAIT_S = 5.0
STAT_NAMES = ("publish_buffer_bytes", "publish_buffer_bytes_in_flight", "publish_buffer_peak_bytes",
              "publish_buffer_waits", "publish_buffer_wait_seconds", "publish_buffer_skips")


@dataclass
class RingSlot:
    """One chunk's room: ``host`` (pinned on CUDA) and, on CUDA, ``dev``; both None for a slot that only counts
    bytes (the publisher of a tp x pp node, whose ranks send fresh host tensors)."""
    index: int
    nbytes: int                          # bytes of chunk data it stands for (one copy; the bound counts these)
    host: Staging | None = None
    dev: Staging | None = None
    dev_index: SlotIndex | None = None   # CUDA: the chunk's cache slots, on the device


class PublishRing:
    def __init__(self, slots: list[RingSlot], wait_s: float = DEFAULT_WAIT_S):
        if not slots:
            raise ValueError("a publish ring needs at least one slot")
        self._free = list(reversed(slots))
        self._count = len(slots)
        self._cond = threading.Condition()
        self.wait_s = wait_s
        self.capacity = sum(s.nbytes for s in slots)
        self.bytes_in_flight = 0
        self.peak_bytes = 0
        self.waits = 0                    # acquires that found the ring full and waited
        self.wait_seconds = 0.0           # engine-thread time spent in those waits
        self.skips = 0                    # acquires that gave up: that chunk was not published
        self._stuck = False               # the last wait timed out and nothing was released since

    @property
    def num_slots(self) -> int:
        return self._count

    def acquire(self) -> RingSlot | None:
        """Engine thread: a free slot, waiting for one if the ring is full; None when none freed in time."""
        with self._cond:
            if not self._free and not self._stuck:
                self.waits += 1
                started = time.monotonic()
                self._cond.wait_for(lambda: self._free, timeout=self.wait_s)
                self.wait_seconds += time.monotonic() - started
                self._stuck = not self._free
            if not self._free:
                self.skips += 1
                return None
            slot = self._free.pop()
            self.bytes_in_flight += slot.nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes_in_flight)
            return slot

    def release(self, slot: RingSlot) -> None:
        """Publisher thread (or the engine thread when a gather failed): the slot may be written again."""
        with self._cond:
            self._free.append(slot)
            self.bytes_in_flight -= slot.nbytes
            self._stuck = False
            self._cond.notify()

    def stats(self) -> dict[str, float]:
        """Levels (capacity, in flight, high-water mark) and event counts, named as ``STAT_NAMES``."""
        with self._cond:
            values = (self.capacity, self.bytes_in_flight, self.peak_bytes, self.waits, round(self.wait_seconds, 6),
                      self.skips)
        return dict(zip(STAT_NAMES, values))


def slot_count(budget_bytes: int, chunk_bytes: int) -> int:
    """Slots of ``chunk_bytes`` that fit ``--kv-publish-buffer-bytes``; raises when not even one does."""
    if budget_bytes < chunk_bytes:
        raise ValueError(f"--kv-publish-buffer-bytes {budget_bytes} cannot hold one KV chunk of {chunk_bytes} bytes "
                         f"(--kv-chunk-tokens x every layer's K and V); give it at least {chunk_bytes}")
    return budget_bytes // chunk_bytes
