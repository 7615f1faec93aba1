"""L1 in the daemon's shared-memory arena: the same LRU memory tier, its bytes where local clients reach them.

Who calls it: ``TieredStore`` (as L1 of the daemon's store: ``config.build_store(arena=True)``), the
daemon's arena handlers (daemon_arena.py: ``reserve``/``commit``/``lease``/``release``/``cancel``), tests.

An object lives in one ``Slot`` (an extent of the arena, see arena.py). A slot's life:

    reserve ──> client writes its bytes ──> commit (now in the index: served) ──> evicted / deleted / replaced
      └─ cancel (client gone, or it moved on without committing): the extent is freed, nothing was served

Only committed slots are ever in the index, so bytes a client is still writing -- or left half written when
it was killed -- are never served: the commit comes after the write, from the writer itself.

Pins: a slot is pinned while a client holds a lease on it (reading it out of the arena), while the daemon's
zmq I/O thread sends it, and while the write-through thread copies it to Redis/disk. Eviction skips pinned
slots; a pinned slot that is deleted or replaced leaves the index at once and gives its extent back when
its last pin goes. So a reader never sees its bytes change under it. ``bytes`` counts committed slots;
reserved ones count too, against the same budget (the arena's size).

Threads: the daemon's serve thread calls everything; the write-through thread calls ``unpin``; a zmq send
completes on zmq's I/O thread and the serve thread unpins after it. One lock guards the index and the
allocator; bytes are copied outside it (a slot being copied is pinned or reserved, so nobody else frees it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kvstore import protocol as P
from pdserve.kvstore.arena import Arena, align
from pdserve.kvstore.base import KVStore, StatsDict, TierStats
from pdserve.kvstore.keys import check_key

log = logging.getLogger(__name__)
STORE_GROUP_BYTES = 8 << 20     # store_many reserves, copies and commits this much at a time


@dataclass(eq=False)
class Slot:
    key: str
    dtype: str
    shape: list[int]
    nbytes: int
    offset: int
    pins: int = 0
    live: bool = False              # in the index (committed, not deleted/evicted/replaced)


class ArenaTier(KVStore):
    name = "memory"                 # the daemon's L1: same stats name as MemoryTier

    def __init__(self, capacity_bytes: int) -> None:
        self.arena = Arena.create(capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self._index: OrderedDict[str, Slot] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = TierStats()
        self._live_bytes = self._pinned_bytes = 0      # extent bytes of committed slots; of those, pinned ones

    # --- the KVStore interface (copies in and out: TCP puts, promotions, in-process use) -------------

    def put(self, items: list[tuple[str, torch.Tensor]]) -> None:
        for key, tensor in items:
            self.store_bytes(P.meta_of(check_key(key), tensor), _raw(tensor))

    def get(self, keys: list[str]) -> list[torch.Tensor | None]:
        with self.borrow(keys) as shared:
            return [None if t is None else t.clone() for t in shared]

    @contextlib.contextmanager
    def borrow(self, keys: list[str]) -> Iterator[list[torch.Tensor | None]]:
        slots = self.pin(keys)
        try:
            yield [None if s is None else self.tensor_of(s) for s in slots]
        finally:
            self.unpin([s for s in slots if s is not None])

    def contains(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [check_key(k) in self._index for k in keys]

    def delete(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                slot = self._index.pop(check_key(key), None)
                if slot is not None:
                    self._retire(slot)

    def stats(self) -> StatsDict:
        with self._lock:
            pinned = sum(1 for s in self._index.values() if s.pins)
        return {self.name: {**self._stats.snapshot(), "pinned": pinned, "arena_free_bytes": self.arena.free_bytes}}

    def close(self) -> None:
        self.arena.close()

    # --- slots ---------------------------------------------------------------------------------------

    def store_bytes(self, meta: P.ObjMeta, data, pin: bool = False) -> Slot | None:
        """Copy ``data`` (``meta.nbytes`` bytes of any buffer) into a new slot and commit it; None if no room.
        ``pin``: the slot comes back pinned (for a write-through copy; the caller unpins)."""
        return self.store_many([(meta, data)], pin)[0]

    def store_many(self, items: list[tuple[P.ObjMeta, object]], pin: bool = False) -> list[Slot | None]:
        """``store_bytes`` for a batch of (meta, buffer): slots reserved under one lock, the bytes copied outside it,
        committed together -- in groups of about ``STORE_GROUP_BYTES``, so a batch never holds much more than that
        reserved beside the objects it replaces."""
        for meta, _ in items:                 # a key no get or delete could name is refused before any slot
            check_key(meta.key)
        out: list[Slot | None] = []
        for group in _groups(items):
            with self._lock:
                slots = [self._reserve(meta) for meta, _ in group]
            reserved = [s for s in slots if s is not None]
            try:
                for slot, (_, data) in zip(slots, group):
                    if slot is not None:
                        self.arena.buf[slot.offset:slot.offset + slot.nbytes] = np.frombuffer(data, dtype=np.uint8)
            except BaseException:
                self.cancel(reserved)             # a buffer that is not its meta's bytes: nothing of its group stays
                raise
            self.commit(reserved, pin=pin)
            out += slots
        return out

    def reserve(self, meta: P.ObjMeta) -> Slot | None:
        """A slot for ``meta``'s bytes (evicting unpinned LRU objects for room); None -- counted -- if none fits."""
        check_key(meta.key)
        with self._lock:
            return self._reserve(meta)

    def _reserve(self, meta: P.ObjMeta) -> Slot | None:
        """``reserve`` with the lock held."""
        offset = self.arena.alloc(meta.nbytes)
        if offset is None and _extent(meta.nbytes) > self.arena.free_bytes + self._evictable_bytes():
            self._stats.add(rejected=1)          # never fits: evicting would empty L1 for nothing
            log.debug("arena tier rejected %s (%d bytes; the arena holds %d, the rest is pinned or reserved)",
                      meta.key, meta.nbytes, self.arena.size)
            return None
        while offset is None:
            victim = next((s for s in self._index.values() if s.pins == 0), None)    # the oldest unpinned
            if victim is None:
                self._stats.add(rejected=1)
                log.debug("arena tier rejected %s (%d bytes; the rest is pinned or reserved)", meta.key, meta.nbytes)
                return None
            del self._index[victim.key]
            self._stats.add(evictions=1)
            self._retire(victim)
            offset = self.arena.alloc(meta.nbytes)
        return Slot(meta.key, meta.dtype, list(meta.shape), meta.nbytes, offset)

    def commit(self, slots: list[Slot], pin: bool = False) -> None:
        """Serve these reserved slots from now on (their bytes are written), replacing older objects."""
        nbytes = sum(s.nbytes for s in slots)
        with self._lock:
            for slot in slots:
                old = self._index.pop(slot.key, None)
                if old is not None:
                    self._retire(old)
                slot.live, slot.pins = True, slot.pins + pin
                self._live_bytes += _extent(slot.nbytes)
                self._pinned_bytes += _extent(slot.nbytes) if slot.pins else 0
                self._index[slot.key] = slot
            self._stats.add(objects=len(slots), bytes=nbytes, bytes_in=nbytes)

    def cancel(self, slots: list[Slot]) -> None:
        """Free reserved slots that were never committed (their writer is gone or moved on)."""
        with self._lock:
            for slot in slots:
                self.arena.free(slot.offset, slot.nbytes)

    def pin(self, keys: list[str]) -> list[Slot | None]:
        """The committed slots of ``keys`` (None: a miss), each pinned once; LRU order refreshed."""
        for key in keys:                          # every key first: a bad one pins nothing (nobody would unpin it)
            check_key(key)
        out: list[Slot | None] = []
        with self._lock:
            for key in keys:
                slot = self._index.get(key)
                if slot is not None:
                    self._pinned_bytes += _extent(slot.nbytes) if slot.pins == 0 else 0
                    slot.pins += 1
                    self._index.move_to_end(key)
                out.append(slot)
            hits = sum(s is not None for s in out)
            self._stats.add(hits=hits, misses=len(out) - hits, bytes_out=sum(s.nbytes for s in out if s))
        return out

    def lease(self, keys: list[str]) -> list[Slot | None]:
        """What the daemon's arena get serves: the pinned slots (the caller unpins them)."""
        return self.pin(keys)

    def unpin(self, slots: list[Slot]) -> None:
        with self._lock:
            for slot in slots:
                slot.pins -= 1
                if slot.pins == 0 and slot.live:
                    self._pinned_bytes -= _extent(slot.nbytes)
                elif slot.pins == 0:
                    self.arena.free(slot.offset, slot.nbytes)

    def tensor_of(self, slot: Slot) -> torch.Tensor:
        """The slot's object as a typed view into the arena (valid while the slot is pinned)."""
        return self.arena.view(slot.offset, slot.nbytes).view(P.dtype_of(slot.dtype)).reshape(slot.shape)

    def bytes_of(self, slot: Slot) -> np.ndarray:
        """The slot's bytes as a numpy uint8 view into the arena (valid while the slot is pinned): what a TCP get
        sends, without building a typed tensor first."""
        return self.arena.buf[slot.offset:slot.offset + slot.nbytes]

    def keys_lru_order(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def _evictable_bytes(self) -> int:
        """Extent bytes of committed, unpinned slots (lock held): the most an eviction could free."""
        return self._live_bytes - self._pinned_bytes

    def _retire(self, slot: Slot) -> None:
        """``slot`` has left the index (lock held): free its extent now, or when its last pin goes."""
        slot.live = False
        self._stats.add(objects=-1, bytes=-slot.nbytes)
        self._live_bytes -= _extent(slot.nbytes)
        self._pinned_bytes -= _extent(slot.nbytes) if slot.pins else 0
        if slot.pins == 0:
            self.arena.free(slot.offset, slot.nbytes)


def _groups(items: list) -> list[list]:
    """``items`` ((meta, buffer) pairs) cut into runs of about ``STORE_GROUP_BYTES`` (one item at least)."""
    groups, size = [[]], 0
    for item in items:
        if groups[-1] and size + item[0].nbytes > STORE_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item[0].nbytes
    return groups if groups[0] else []


def _raw(tensor: torch.Tensor):
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _extent(nbytes: int) -> int:
    """The bytes ``Arena.alloc`` takes for an object of ``nbytes``."""
    return align(max(nbytes, 1))
