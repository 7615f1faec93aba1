"""L1 in the daemon's shared-memory arena: the same LRU memory tier, its bytes where local clients reach them.

Who calls it: ``TieredStore`` (as L1 of the daemon's store: ``config.build_store(arena=True)``), the
daemon's arena handlers (daemon_arena.py: ``reserve``/``commit``/``lease``/``release``/``cancel``), tests.

An object lives in one ``Slot`` (an extent of the arena, see arena.py). A slot's life:

    reserve ──> client writes its bytes ──> commit (now in the index: served) ──> evicted / deleted / replaced
      └─ cancel (client gone, or it moved on without committing): the extent is freed, nothing was served

Only committed slots are ever in the index, so bytes a client is still writing -- or left half written when
it was killed -- are never served: the commit comes after the write, from the writer itself.

Frame-backed slots (a TCP put's objects from ``KEEP_FRAME_FROM`` bytes: ``store_many(keep=True)``): the daemon
hands over the zmq frames it received -- memory nobody else holds or writes -- and the slot keeps that frame as
its bytes (``Slot.data``, offset -1) instead of copying it into the arena. TCP gets and the write-through thread
read it there. A mapped client can only read the arena, so a Lease first ``place``s the slot: its bytes are
copied into an arena extent once, and it is an ordinary arena slot from then on. Capacity counts both kinds:
arena extents in use (reserved, committed, or retired but pinned) plus frame-backed slots' bytes (``_frame_bytes``)
stay within the arena's size, and eviction (oldest unpinned first) frees either kind -- except when there is room
but no free extent long enough: then only arena slots go (a frame holds none). A place takes its extent in the room
its frame counted (a full L1 evicts nothing for it); while it copies, the frame and the extent both exist.

Pins: a slot is pinned while a client holds a lease on it (reading it out of the arena), while the daemon's
zmq I/O thread sends it, and while the write-through thread copies it to Redis/disk. Eviction skips pinned
slots; a pinned slot that is deleted or replaced leaves the index at once and gives its extent back when
its last pin goes (a frame-backed slot drops its frame then). So a reader never sees its bytes change under it.
``bytes`` counts committed slots; reserved ones count too, against the same budget (the arena's size).

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
from pdserve.kvstore.arena import ALIGN, Arena, align
from pdserve.kvstore.base import KVStore, StatsDict, TierStats
from pdserve.kvstore.keys import check_key

log = logging.getLogger(__name__)
_ALIGN_MASK = ALIGN - 1             # (ALIGN is a power of two)
STORE_GROUP_BYTES = 8 << 20     # store_many reserves, copies and commits this much at a time
KEEP_FRAME_FROM = P.KEEP_FRAME_FROM  # store_many(keep=True) keeps buffers from this size as they are; smaller ones
#                                     are copied (a small zmq frame may share the I/O thread's 8 KiB receive buffer)


@dataclass(eq=False)
class Slot:
    key: str
    dtype: str
    shape: list[int]
    nbytes: int
    offset: int
    pins: int = 0
    live: bool = False              # in the index (committed, not deleted/evicted/replaced)
    data: np.ndarray | None = None  # frame-backed: its bytes ([nbytes] uint8, a received frame's); offset is -1
    source: object = None           # frame-backed: the buffer it was given (the daemon sends a zmq frame as itself)
    digest: int | None = None       # frame-backed: its meta's wire digest, checked against these (unchanging) bytes
    #                                 by the daemon's Put before ``keep_frames``; a TCP get sends it without rehashing


class ArenaTier(KVStore):
    name = "memory"                 # the daemon's L1: same stats name as MemoryTier

    def __init__(self, capacity_bytes: int) -> None:
        self.arena = Arena.create(capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self._index: OrderedDict[str, Slot] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = TierStats()
        self._live_bytes = self._pinned_bytes = 0      # extent bytes of committed slots; of those, pinned ones
        self._frame_bytes = 0                          # extent bytes of frame-backed slots not yet dropped

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
            frames = self._frame_bytes
        return {self.name: {**self._stats.snapshot(), "pinned": pinned, "arena_free_bytes": self.arena.free_bytes,
                            "frame_bytes": frames}}

    def close(self) -> None:
        self.arena.close()

    # --- slots ---------------------------------------------------------------------------------------

    def store_bytes(self, meta: P.ObjMeta, data, pin: bool = False) -> Slot | None:
        """Copy ``data`` (``meta.nbytes`` bytes of any buffer) into a new slot and commit it; None if no room.
        ``pin``: the slot comes back pinned (for a write-through copy; the caller unpins)."""
        return self.store_many([(meta, data)], pin)[0]

    def store_many(self, items: list[tuple[P.ObjMeta, object]], pin: bool = False,
                   keep: bool = False) -> list[Slot | None]:
        """``store_bytes`` for a batch of (meta, buffer): slots reserved under one lock, the bytes copied outside it,
        committed together -- in groups of about ``STORE_GROUP_BYTES``, so a batch never holds much more than that
        reserved beside the objects it replaces. ``keep``: the buffers are given to the tier (received frames no
        one else holds or writes, each meta's ``digest`` checked against them): those from ``KEEP_FRAME_FROM`` bytes
        become frame-backed slots, not copied."""
        for meta, data in items:              # a key no get or delete could name is refused before any slot,
            check_key(meta.key)               # and so is a buffer to keep that is not its meta's length
            if keep and meta.nbytes >= KEEP_FRAME_FROM and memoryview(data).nbytes != meta.nbytes:
                raise ValueError(f"object {meta.key!r}: buffer has {memoryview(data).nbytes} bytes, "
                                 f"meta says {meta.nbytes}")
        out: list[Slot | None] = []
        for group in _groups(items):
            with self._lock:
                slots = [self._keep(meta, data) if keep and meta.nbytes >= KEEP_FRAME_FROM else self._reserve(meta)
                         for meta, data in group]
            reserved = [s for s in slots if s is not None]
            try:
                for slot, (_, data) in zip(slots, group):
                    if slot is not None and slot.data is None:
                        self.arena.buf[slot.offset:slot.offset + slot.nbytes] = np.frombuffer(data, dtype=np.uint8)
            except BaseException:
                self.cancel(reserved)             # a buffer that is not its meta's bytes: nothing of its group stays
                raise
            self.commit(reserved, pin=pin)
            out += slots
        return out

    def keep_frames(self, items: list[tuple[P.ObjMeta, object]]) -> list[Slot | None]:
        """``store_many(keep=True)``: what the daemon calls when L1 is this tier alone (no ``TieredStore``)."""
        return self.store_many(items, keep=True)

    def reserve(self, meta: P.ObjMeta) -> Slot | None:
        """A slot for ``meta``'s bytes (evicting unpinned LRU objects for room); None -- counted -- if none fits."""
        check_key(meta.key)
        with self._lock:
            return self._reserve(meta)

    def _reserve(self, meta: P.ObjMeta) -> Slot | None:
        """``reserve`` with the lock held."""
        offset = self._alloc(meta.key, meta.nbytes)
        return None if offset is None else Slot(meta.key, meta.dtype, list(meta.shape), meta.nbytes, offset)

    def _keep(self, meta: P.ObjMeta, data) -> Slot | None:
        """A frame-backed slot holding ``data`` itself (lock held); None -- counted -- if no room can be made."""
        if not self._make_room(meta.key, meta.nbytes):
            return None
        self._frame_bytes += _extent(meta.nbytes)
        return Slot(meta.key, meta.dtype, list(meta.shape), meta.nbytes, -1,
                    data=np.frombuffer(data, dtype=np.uint8), source=data, digest=meta.digest)

    def place(self, slot: Slot) -> bool:
        """Copy a pinned frame-backed slot's bytes into an arena extent (where a mapped client reads them); it is an
        ordinary arena slot from then on. False when no room can be made (the caller sends the bytes as a frame)."""
        data = slot.data
        if data is None:
            return True
        with self._lock:
            self._frame_bytes -= _extent(slot.nbytes)         # its frame goes once copied: the room it takes is the
            offset = self._alloc(slot.key, slot.nbytes)      # frame's (a full L1 evicts nothing); pinned: no victim
            if offset is None:
                self._frame_bytes += _extent(slot.nbytes)
                return False
        self.arena.buf[offset:offset + slot.nbytes] = data   # outside the lock: the extent is ours, the frame immutable
        with self._lock:
            slot.offset = offset                              # (offset first: a reader that sees data None finds it)
            slot.data = slot.source = slot.digest = None
        return True

    def _alloc(self, key: str, nbytes: int) -> int | None:
        """An arena extent for ``nbytes`` (lock held), evicting unpinned LRU objects for room; None -- counted --
        if none can be made."""
        while True:
            if not self._make_room(key, nbytes):
                return None
            offset = self.arena.alloc(nbytes)
            if offset is not None:
                return offset
            if not self._evict_oldest(in_arena=True):    # room enough, but no free extent that long: only an
                self._reject(key, nbytes)                # arena slot's going can make one (a frame holds none)
                return None

    def _make_room(self, key: str, nbytes: int) -> bool:
        """Evict unpinned LRU objects until ``nbytes`` more fit within the arena's size (lock held)."""
        need = _extent(nbytes)
        if self._used_bytes() + need <= self.arena.size:
            return True                                 # (the common case, in one comparison)
        if need > self.arena.size - self._used_bytes() + self._evictable_bytes():
            return self._reject(key, nbytes)            # never fits: evicting would empty L1 for nothing
        while self._used_bytes() + need > self.arena.size:
            if not self._evict_oldest():
                return self._reject(key, nbytes)
        return True

    def _evict_oldest(self, in_arena: bool = False) -> bool:
        """Evict the oldest unpinned object (``in_arena``: the oldest unpinned arena slot); False if none."""
        victim = next((s for s in self._index.values() if s.pins == 0 and not (in_arena and s.data is not None)),
                      None)
        if victim is None:
            return False
        del self._index[victim.key]
        self._stats.add(evictions=1)
        self._retire(victim)
        return True

    def _reject(self, key: str, nbytes: int) -> bool:
        self._stats.add(rejected=1)
        log.debug("arena tier rejected %s (%d bytes; the arena holds %d, the rest is pinned or reserved)",
                  key, nbytes, self.arena.size)
        return False

    def _used_bytes(self) -> int:
        """Bytes counted against the arena's size (lock held): its extents in use, and frame-backed slots."""
        return self.arena.size - self.arena.free_bytes + self._frame_bytes

    def commit(self, slots: list[Slot], pin: bool = False) -> None:
        """Serve these reserved slots from now on (their bytes are written), replacing older objects."""
        nbytes = sum(s.nbytes for s in slots)
        with self._lock:
            gone = gone_bytes = 0                       # the objects these replace (their stats: one add)
            for slot in slots:
                old = self._index.pop(slot.key, None)
                if old is not None:
                    self._retire(old, counted=False)
                    gone, gone_bytes = gone + 1, gone_bytes + old.nbytes
                slot.live, slot.pins = True, slot.pins + pin
                extent = _extent(slot.nbytes)
                self._live_bytes += extent
                self._pinned_bytes += extent if slot.pins else 0
                self._index[slot.key] = slot
            self._stats.add(objects=len(slots) - gone, bytes=nbytes - gone_bytes, bytes_in=nbytes)

    def cancel(self, slots: list[Slot]) -> None:
        """Free reserved slots that were never committed (their writer is gone or moved on)."""
        with self._lock:
            for slot in slots:
                self._free(slot)

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
                    self._free(slot)

    def tensor_of(self, slot: Slot) -> torch.Tensor:
        """The slot's object as a typed view into the arena or its frame (valid while the slot is pinned)."""
        data = slot.data
        raw = self.arena.view(slot.offset, slot.nbytes) if data is None else torch.frombuffer(data, dtype=torch.uint8)
        return raw.view(P.dtype_of(slot.dtype)).reshape(slot.shape)

    def bytes_of(self, slot: Slot) -> np.ndarray:
        """The slot's bytes as a numpy uint8 view into the arena or its frame (valid while the slot is pinned): what a
        TCP get sends, without building a typed tensor first."""
        data = slot.data
        return self.arena.buf[slot.offset:slot.offset + slot.nbytes] if data is None else data

    def source_of(self, slot: Slot):
        """A frame-backed slot's buffer as it was given (a received zmq frame), else None."""
        return slot.source

    def keys_lru_order(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def _evictable_bytes(self) -> int:
        """Extent bytes of committed, unpinned slots (lock held): the most an eviction could free."""
        return self._live_bytes - self._pinned_bytes

    def _retire(self, slot: Slot, counted: bool = True) -> None:
        """``slot`` has left the index (lock held): free its extent now, or when its last pin goes. ``counted``:
        False when the caller takes it off the ``objects``/``bytes`` stats itself (``commit``, once a batch)."""
        slot.live = False
        if counted:
            self._stats.add(objects=-1, bytes=-slot.nbytes)
        extent = _extent(slot.nbytes)
        self._live_bytes -= extent
        self._pinned_bytes -= extent if slot.pins else 0
        if slot.pins == 0:
            self._free(slot)

    def _free(self, slot: Slot) -> None:
        """Give a retired, unpinned slot's bytes back (lock held): its arena extent, or its frame."""
        if slot.data is None:
            self.arena.free(slot.offset, slot.nbytes)
        else:
            self._frame_bytes -= _extent(slot.nbytes)
            slot.data = slot.source = None


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
    """The bytes ``Arena.alloc`` takes for an object of ``nbytes`` (``align(max(nbytes, 1))``, in one step: it runs
    several times per object a TCP put stores)."""
    return (nbytes + _ALIGN_MASK) & ~_ALIGN_MASK if nbytes > 0 else ALIGN
