"""L1: tensors in CPU memory under a byte budget, least-recently-used first out.

Who calls it: ``TieredStore`` (as L1), the daemon (through TieredStore), tests.
An entry is pinned while a reader copies it (``get``/``borrow``); eviction skips pinned
entries, so a load never loses its source and the budget holds exactly: ``bytes <=
capacity_bytes`` at all times. An object that cannot fit (bigger than the budget, or
everything else pinned) is rejected and counted, never raised. ``adopt`` keeps a tensor
that owns exactly its bytes and copies a view of a larger storage (``compact``), so
``bytes`` is the memory L1 really holds, not the sum of views into one big tensor.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pdserve.kvstore.base import KVStore, StatsDict, TierStats
from pdserve.kvstore.keys import check_key

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    tensor: torch.Tensor
    nbytes: int
    pins: int = 0


class MemoryTier(KVStore):
    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"memory tier needs a budget > 0 bytes, got {capacity_bytes} (--kv-cpu-bytes)")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = TierStats()

    def put(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.adopt([(key, tensor.detach().contiguous().clone()) for key, tensor in items])

    def adopt(self, items: list[tuple[str, torch.Tensor]]) -> None:
        for key, tensor in items:
            check_key(key)
            tensor = compact(tensor.detach())
            nbytes = tensor.numel() * tensor.element_size()
            with self._lock:
                self._insert(key, _Entry(tensor, nbytes))

    def get(self, keys: list[str]) -> list[torch.Tensor | None]:
        with self.borrow(keys) as shared:
            return [None if t is None else t.clone() for t in shared]

    @contextlib.contextmanager
    def borrow(self, keys: list[str]) -> Iterator[list[torch.Tensor | None]]:
        entries = self._pin(keys)
        try:
            yield [None if e is None else e.tensor for e in entries]
        finally:
            with self._lock:
                for e in entries:
                    if e is not None:
                        e.pins -= 1

    def contains(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [check_key(k) in self._entries for k in keys]

    def delete(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                entry = self._entries.pop(check_key(key), None)
                if entry is not None:
                    self._stats.add(objects=-1, bytes=-entry.nbytes)

    def keys_lru_order(self) -> list[str]:
        """Oldest first: the order eviction will take (pinned entries are skipped)."""
        with self._lock:
            return list(self._entries)

    def stats(self) -> StatsDict:
        with self._lock:
            pinned = sum(1 for e in self._entries.values() if e.pins)
        return {self.name: {**self._stats.snapshot(), "pinned": pinned}}

    def _pin(self, keys: list[str]) -> list[_Entry | None]:
        out: list[_Entry | None] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(check_key(key))
                if entry is not None:
                    entry.pins += 1
                    self._entries.move_to_end(key)
                out.append(entry)
            hits = sum(e is not None for e in out)
            self._stats.add(hits=hits, misses=len(out) - hits,
                            bytes_out=sum(e.nbytes for e in out if e is not None))
        return out

    def _insert(self, key: str, entry: _Entry) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._stats.add(objects=-1, bytes=-old.nbytes)
        if not self._make_room(entry.nbytes):
            self._stats.add(rejected=1)
            log.debug("memory tier rejected %s (%d bytes, budget %d)", key, entry.nbytes, self.capacity_bytes)
            return
        self._entries[key] = entry
        self._stats.add(objects=1, bytes=entry.nbytes, bytes_in=entry.nbytes)

    def _make_room(self, nbytes: int) -> bool:
        """Evict unpinned entries, oldest first, until ``nbytes`` fit; False (nothing evicted) if they cannot."""
        need = self._stats.bytes + nbytes - self.capacity_bytes
        victims: list[str] = []
        for key, entry in self._entries.items():
            if need <= 0:
                break
            if entry.pins == 0:
                victims.append(key)
                need -= entry.nbytes
        if need > 0:
            return False
        for key in victims:
            entry = self._entries.pop(key)
            self._stats.add(objects=-1, bytes=-entry.nbytes, evictions=1)
            log.debug("memory tier evicted %s (%d bytes)", key, entry.nbytes)
        return True


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it owns exactly its bytes; else a contiguous copy that does.

    A view (one layer of ``layers.unbind(0)``, a slice, a transpose) keeps its whole base
    storage alive: L1 would count the view's bytes while holding the base's. Copying it
    makes L1's ``bytes`` the memory it really holds.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
