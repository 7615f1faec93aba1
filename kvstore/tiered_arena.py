"""``TieredStore``'s methods for an L1 in the daemon's arena (``ArenaTier``): slots written and read in place.

Who calls it: the daemon (daemon.py, daemon_arena.py) through its ``TieredStore``; ``TieredStore`` mixes this in
and provides ``l1``, ``lower``, ``_enqueue`` and ``_fill_from_lower``. A slot committed here is pinned for the
write-through thread, which reads its bytes straight from the arena and unpins it once Redis/disk have them
(or the write is dropped): eviction never reuses bytes still on their way down. A TCP put's received frames are
given to L1 (``keep_frames``: large ones become frame-backed slots, no copy); a Lease ``place``s such a slot in
the arena first.
"""

from __future__ import annotations

import torch


class ArenaSlots:
    @property
    def arena(self):
        """L1's shared-memory arena (an ``ArenaTier`` L1: the daemon's store), else None."""
        return getattr(self.l1, "arena", None)

    def store_bytes(self, meta, data) -> None:
        """Copy one object's bytes (any buffer) into a new L1 slot, and queue it for the lower tiers."""
        slot = self.l1.store_bytes(meta, data, pin=bool(self.lower))
        if slot is not None and self.lower:
            self._enqueue_slots([slot])

    def store_many(self, items: list) -> None:
        """``store_bytes`` for a batch of (meta, buffer) pairs (one lock for their slots, one commit)."""
        slots = [s for s in self.l1.store_many(items, pin=bool(self.lower)) if s is not None]
        if slots and self.lower:
            self._enqueue_slots(slots)

    def keep_frames(self, items: list) -> None:
        """``store_many`` for (meta, received frame buffer) pairs the caller gives away: L1 keeps large ones as they
        are (frame-backed slots) rather than copying them into the arena."""
        slots = [s for s in self.l1.store_many(items, pin=bool(self.lower), keep=True) if s is not None]
        if slots and self.lower:
            self._enqueue_slots(slots)

    def place(self, slot) -> bool:
        return self.l1.place(slot)

    def reserve(self, meta):
        return self.l1.reserve(meta)

    def cancel(self, slots: list) -> None:
        self.l1.cancel(slots)

    def commit(self, slots: list) -> None:
        """Serve reserved slots whose bytes are written; their bytes go to the lower tiers from the arena."""
        self.l1.commit(slots, pin=bool(self.lower))
        if self.lower:
            self._enqueue_slots(slots)

    def lease(self, keys: list[str]) -> list:
        """Per key: its pinned L1 slot, else a lower tier's tensor that could not be promoted, else None."""
        out: list = self.l1.pin(keys)
        fresh = self._fill_from_lower(keys, out)
        if fresh:
            self.l1.adopt([(keys[i], out[i]) for i in fresh])
            for i, slot in zip(fresh, self.l1.pin([keys[i] for i in fresh])):
                out[i] = slot if slot is not None else out[i]
        return out

    def unpin(self, slots: list) -> None:
        self.l1.unpin(slots)

    def tensor_of(self, slot) -> torch.Tensor:
        return self.l1.tensor_of(slot)

    def bytes_of(self, slot):
        return self.l1.bytes_of(slot)

    def source_of(self, slot):
        return self.l1.source_of(slot)

    def _enqueue_slots(self, slots: list) -> None:
        """Queue pinned slots' arena views for write-through; unpinned once written (or dropped)."""
        self._enqueue([(s.key, self.l1.tensor_of(s)) for s in slots], release=lambda: self.l1.unpin(slots))
