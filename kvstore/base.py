"""The one narrow interface every store implements, and the per-tier counters.

Implementations: ``MemoryTier`` (L1), ``RedisTier`` (L2), ``DiskTier`` (L3), ``TieredStore``
(L1 -> L2 -> L3) and ``DaemonClient`` (a store in another process). One contract suite
(tests/test_kvstore_contract.py) runs against all of them.

Calling order for a reader (the decode node):
    n = store.lookup(chunk_keys, num_layers)      # leading chunks with every layer present
    with store.borrow([object_key(c, l) ...]) as tensors:   # pinned while loading
        copy tensors into the paged cache          # a None is a miss -> recompute
A writer (the prefill node) calls ``put`` (or ``adopt`` to hand over ownership).

Objects are CPU tensors; ``get`` returns tensors the caller owns (fresh copies).
A miss is ``None``, never an exception; a corrupt object is a counted miss and deleted.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch

from pdserve.kvstore.keys import object_key

StatsDict = dict[str, dict[str, int]]


class KVStore(abc.ABC):
    """put/get/contains/lookup/delete/stats/close over ``(key, CPU tensor)`` objects."""

    @abc.abstractmethod
    def put(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Store copies of the tensors (the caller keeps its tensors)."""

    @abc.abstractmethod
    def get(self, keys: list[str]) -> list[torch.Tensor | None]:
        """Fresh tensors the caller owns, None for a miss."""

    @abc.abstractmethod
    def contains(self, keys: list[str]) -> list[bool]: ...

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None: ...

    @abc.abstractmethod
    def stats(self) -> StatsDict:
        """``{tier name: {counter: value}}`` (see TierStats)."""

    def close(self) -> None:
        """Release connections, threads and files. Idempotent."""

    def adopt(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Like put, but the store may keep the tensors themselves (caller must not touch them)."""
        self.put(items)

    @contextlib.contextmanager
    def borrow(self, keys: list[str]) -> Iterator[list[torch.Tensor | None]]:
        """Tensors to read (not write) while the block lasts; hits stay pinned until exit."""
        yield self.get(keys)

    def discard(self, key: str, refused: torch.Tensor) -> None:
        """A reader refused ``refused``, read under ``key`` (its seal failed): remove it. Here every copy of ``key``;
        a store that keeps several copies (``TieredStore``) removes only those holding the refused bytes."""
        self.discard_where(key, lambda copy: torch.equal(copy, refused))

    def discard_where(self, key: str, is_refused) -> None:
        """``discard`` with the refused bytes known by a test, ``is_refused(copy)`` (one copy here: deleted)."""
        self.delete([key])

    def delete_nowait(self, keys: list[str]) -> "Removal | None":
        """``delete`` without waiting on slower tiers (what the daemon's serve thread calls): reads through this
        store miss ``keys`` at once; a store of tiers (``TieredStore``) removes its lower tiers' copies behind, and
        returns a ``Removal`` set once it has. None: done already."""
        self.delete(keys)
        return None

    def discard_where_nowait(self, key: str, is_refused) -> "Removal | None":
        """``discard_where`` without waiting on slower tiers, as ``delete_nowait``."""
        self.discard_where(key, is_refused)
        return None

    def discards_nowait(self, refusals: list[tuple[str, object]]) -> "list[Removal | None]":
        """``discard_where_nowait`` of each (key, is_refused): the daemon's Discard of several keys. A store with a
        bounded removal queue (``TieredStore``) takes all of them or none."""
        return [self.discard_where_nowait(key, is_refused) for key, is_refused in refusals]

    def lookup(self, chunk_keys: list[str], num_layers: int) -> int:
        """Number of leading chunks whose every layer object is present."""
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        present = self.contains([object_key(c, layer) for c in chunk_keys for layer in range(num_layers)])
        for i in range(len(chunk_keys)):
            if not all(present[i * num_layers:(i + 1) * num_layers]):
                return i
        return len(chunk_keys)

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class TierStats:
    """Counters one tier keeps; ``snapshot()`` is what ``stats()`` and /metrics report.

    ``objects``/``bytes`` are levels (gauges); the rest count events (counters). The one
    classification of every stat name lives in ``kvstore/metrics.py``.
    """

    objects: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0
    checksum_failures: int = 0
    key_mismatch: int = 0       # intact objects written for another key (counted misses, deleted)
    rejected: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self)}


class Removal(threading.Event):
    """Set once a queued delete or discard has been over every lower tier; ``missed``: the tiers that were down for it
    (the removal is kept for them and retried once they are back: kvstore/removals.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.missed: tuple[str, ...] = ()
