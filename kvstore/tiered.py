"""The store an engine or the daemon uses: L1 memory -> L2 Redis -> L3 disk.

Who calls it: the engine's KV connector (embedded store, the default), the daemon
(``pdserve kvstore``), the bench, tests. Built from flags by ``config.build_store``.

    put/adopt ──> L1 (sync) ──> write-through queue (bounded by bytes; full -> drop, count)
                                   └─ worker thread ──> L2.put, L3.put   (tiers that are up)
    get/borrow ──> L1 ──miss──> L2 ──miss──> L3 ; a lower-tier hit is promoted to L1
    contains/lookup: L1, then the lower tiers for what L1 lacks
    delete: L1, wait for queued writes, then every lower tier

A lower tier that raises is marked down (``TierHealth``: back-off, then a probe) and
skipped meanwhile: a dead Redis costs hits, never a failed call. L1 errors do propagate
(they are programming errors, not outages).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator

import torch

from pdserve.kvstore.base import KVStore, StatsDict
from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.memory import MemoryTier

log = logging.getLogger(__name__)
Items = list[tuple[str, torch.Tensor]]


class TieredStore(KVStore):
    name = "tiered"

    def __init__(self, l1: MemoryTier, lower: list[KVStore] = (), queue_bytes: int = 256 << 20,
                 backoff_base_s: float = 0.5, backoff_max_s: float = 30.0) -> None:
        self.l1, self.lower, self.queue_bytes = l1, list(lower), queue_bytes
        self.health = {t.name: TierHealth(t.name, backoff_base_s, backoff_max_s) for t in self.lower}
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._wt = {"written": 0, "dropped": 0, "skipped_down": 0}
        self._worker = threading.Thread(target=self._write_loop, name="kv-write-through", daemon=True)
        self._closed = False
        if self.lower:
            self._worker.start()

    def put(self, items: Items) -> None:
        self.adopt([(key, t.detach().contiguous().clone()) for key, t in items])

    def adopt(self, items: Items) -> None:
        self.l1.adopt(items)
        self._enqueue(items)

    def get(self, keys: list[str]) -> list[torch.Tensor | None]:
        out = self.l1.get(keys)
        for i in self._fill_from_lower(keys, out):
            self.l1.adopt([(keys[i], out[i].clone())])
        return out

    @contextlib.contextmanager
    def borrow(self, keys: list[str]) -> Iterator[list[torch.Tensor | None]]:
        with self.l1.borrow(keys) as shared:
            out = list(shared)
            fresh = self._fill_from_lower(keys, out)
            self.l1.adopt([(keys[i], out[i]) for i in fresh])
            yield out

    def contains(self, keys: list[str]) -> list[bool]:
        present = self.l1.contains(keys)
        for tier in self.lower:
            missing = [i for i, p in enumerate(present) if not p]
            found = self._call(tier, "contains", [keys[i] for i in missing]) if missing else None
            for i, hit in zip(missing, found or []):
                present[i] = hit
        return present

    def delete(self, keys: list[str]) -> None:
        self.l1.delete(keys)
        self.flush()
        for tier in self.lower:
            self._call(tier, "delete", keys)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every write queued so far reached the lower tiers (or was skipped)."""
        if not self.lower or self._closed:
            return True
        done = threading.Event()
        self._queue.put(("flush", done))
        return done.wait(timeout_s)

    def stats(self) -> StatsDict:
        out = self.l1.stats()
        for tier in self.lower:
            for name, counters in tier.stats().items():
                out[name] = {**counters, **self.health[tier.name].snapshot()}
        with self._lock:
            out["writethrough"] = {**self._wt, "queued_bytes": self._queued_bytes}
        return out

    def close(self) -> None:
        if self._closed:
            return
        if self.lower:
            self._queue.put(("stop", None))
            self._worker.join(timeout=30.0)
        self._closed = True
        for tier in self.lower:
            tier.close()

    def _fill_from_lower(self, keys: list[str], out: list) -> list[int]:
        """Fill L1 misses in ``out`` from L2, then L3; returns the indices filled."""
        filled: list[int] = []
        for tier in self.lower:
            missing = [i for i, t in enumerate(out) if t is None]
            if not missing:
                break
            found = self._call(tier, "get", [keys[i] for i in missing]) or []
            for i, tensor in zip(missing, found):
                if tensor is not None:
                    out[i] = tensor
                    filled.append(i)
        return filled

    def _enqueue(self, items: Items) -> None:
        if not self.lower or not items:
            return
        nbytes = sum(t.numel() * t.element_size() for _, t in items)
        with self._lock:
            if self._queued_bytes + nbytes > self.queue_bytes:
                self._wt["dropped"] += len(items)
                log.debug("write-through queue full (%d bytes queued, limit %d): dropped %d objects",
                          self._queued_bytes, self.queue_bytes, len(items))
                return
            self._queued_bytes += nbytes
        self._queue.put(("put", (items, nbytes)))

    def _write_loop(self) -> None:
        while True:
            op, arg = self._queue.get()
            if op == "stop":
                return
            if op == "flush":
                arg.set()
                continue
            items, nbytes = arg
            for tier in self.lower:
                written = self._call(tier, "put", items, skipped=len(items))
                with self._lock:
                    self._wt["written"] += len(items) if written is not _FAILED else 0
            with self._lock:
                self._queued_bytes -= nbytes

    def _call(self, tier: KVStore, method: str, arg, skipped: int = 0):
        """``tier.method(arg)`` if the tier is up; _FAILED (or None for reads) when down or failing."""
        health = self.health[tier.name]
        if not health.available():
            with self._lock:
                self._wt["skipped_down"] += skipped
            return _FAILED if method == "put" else None
        try:
            result = getattr(tier, method)(arg)
        except Exception as exc:  # noqa: BLE001 - any backend failure marks the tier down
            health.failed(exc)
            return _FAILED if method == "put" else None
        health.ok()
        return result


_FAILED = object()
