"""The store an engine or the daemon uses: L1 memory -> L2 Redis -> L3 disk.

Who calls it: the engine's KV connector (embedded store, the default), the daemon
(``pdserve kvstore``), the bench, tests. Built from flags by ``config.build_store``.

    put/adopt ──> L1 (sync) ──> write-through queue (bounded by bytes, see below)
                                   └─ worker thread ──> L2.put, L3.put   (tiers that are up)
    get/borrow ──> L1 ──miss──> L2 ──miss──> L3 ; a lower-tier hit is promoted to L1
    contains/lookup: L1, then the lower tiers for what L1 lacks
    delete: L1 now; every lower tier by the worker, behind the writes queued before it (none lands after)
    discard (a loader refused an object's seal): the same, each lower tier's copy of the refused bytes only
    Until the worker has removed them, this store's reads miss those keys in the lower tiers (``_deleting``).
    A tier that misses a removal (down, or it raised) gets it again once it takes calls (removals.py): the key
    stays hidden from that tier meanwhile, and a later write of it that reaches the tier supersedes it.
    ``delete``/``discard_where`` wait for the worker (at most 30 s); the ``_nowait`` forms return an Event set
    once it is done -- the daemon's serve thread answers the Delete then, serving other clients meanwhile, so
    a slow Redis never stalls every client behind one Delete.

Write-through queue: an empty queue accepts any batch (one batch may exceed
``queue_bytes``); a non-empty queue that the batch would overflow drops it: memory stays
bounded, the drop is counted (``writethrough.dropped``) and logged at WARNING once per
full episode (until a batch is accepted again).

Durable writers (the prefill publisher: one thread, ``adopt()`` then ``flush()`` per
chunk) rely on ``flush(timeout_s)``: True only if every write enqueued since the previous
flush reached every lower tier; False if any was dropped, failed in a tier (it raised)
or was skipped because a tier was down, or on timeout. Losses are kept per writer thread:
two prefill engines sharing one embedded store each get their own report.

A lower tier that raises is marked down (``TierHealth``: back-off, then a probe) and
skipped meanwhile: a dead Redis costs hits, never a failed call. L1 errors do propagate
(they are programming errors, not outages).

Stats: each lower tier's entry adds its health and its write-through outcomes in objects
(``wt_written``, ``wt_failed``, ``wt_skipped_down``); ``writethrough`` has ``dropped``,
``lost`` (objects that did not reach every tier, drops included), ``queued_bytes``,
``queued_objects``, ``removals_queued`` (keys in queued deletes/discards: at ``MAX_QUEUED_REMOVALS`` a new removal
is refused whole, ``RemovalQueueFull``), ``removals_pending`` (kept for a tier that missed them) and
``removals_abandoned``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator

import torch

from pdserve.kvstore import protocol as P
from pdserve.kvstore.base import KVStore, Removal, StatsDict
from pdserve.kvstore.codec import tensor_bytes
from pdserve.kvstore.tiered_arena import ArenaSlots
from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.keys import check_key
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.removals import PendingRemovals

log = logging.getLogger(__name__)
Items = list[tuple[str, torch.Tensor]]
RETRY_S = 0.5               # an idle worker with removals kept for a down tier looks at the tier this often
RETRY_BATCH = 1024          # keys per retried delete
MAX_QUEUED_REMOVALS = 131_072   # keys in queued deletes and discards (128 full Delete batches, tens of MB at most):
#                                 a removal that would pass it is refused whole (RemovalQueueFull), nothing done


class RemovalQueueFull(RuntimeError):
    """A delete or discard refused, nothing done: the lower tiers' queued removals are at ``MAX_QUEUED_REMOVALS``
    keys (a stalled tier). The caller may retry once they drain; the daemon answers it as an error."""


class TieredStore(ArenaSlots, KVStore):
    name = "tiered"

    def __init__(self, l1: MemoryTier, lower: list[KVStore] = (), queue_bytes: int = 256 << 20,
                 backoff_base_s: float = 0.5, backoff_max_s: float = 30.0) -> None:
        self.l1, self.lower, self.queue_bytes = l1, list(lower), queue_bytes
        self.health = {t.name: TierHealth(t.name, backoff_base_s, backoff_max_s) for t in self.lower}
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._queued_bytes = self._queued_objects = 0
        self._queued_removals = 0          # keys in queued deletes/discards (under _lock), <= MAX_QUEUED_REMOVALS
        self._episode_dropped = 0          # objects dropped since the queue last accepted a batch
        self._wt = {"dropped": 0, "lost": 0}
        self._tier_wt = {t.name: {"wt_written": 0, "wt_failed": 0, "wt_skipped_down": 0} for t in self.lower}
        self._unreported_lost: dict[int, int] = {}   # worker only: writer thread -> lost since its last flush
        self._deleting: dict[str, int] = {}  # key -> its queued deletes/discards (under _lock): lower tiers miss it
        self._kept: dict[str, set[str]] = {t.name: set() for t in self.lower}   # tier -> keys whose removal is
        #                                      kept for it (under _lock): that tier alone misses them
        self._pending = PendingRemovals([t.name for t in self.lower])    # worker only
        self._worker = threading.Thread(target=self._write_loop, name="kv-write-through", daemon=True)
        self._closed = self._stopping = False
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
        deleting, kept = self._being_deleted(keys)
        for tier in self.lower:
            hidden = kept.get(tier.name, ())
            missing = [i for i, p in enumerate(present) if not p and keys[i] not in deleting and keys[i] not in hidden]
            found = self._read(tier, "contains", [keys[i] for i in missing]) if missing else None
            for i, hit in zip(missing, found or []):
                present[i] = hit
        return present

    def delete(self, keys: list[str]) -> None:
        self._remove(keys, wait=True)

    def delete_nowait(self, keys: list[str]) -> Removal | None:
        return self._remove(keys, wait=False)

    def discard(self, key: str, refused: torch.Tensor) -> None:
        """``KVStore.discard`` by the refused bytes' digest (``protocol.digest_of``, as the daemon's Discard), not by
        the tensor: a removal kept for a down tier then holds an int, not the object (removals.MAX_KEYS per tier)."""
        digest = P.digest_of(key, tensor_bytes(refused))
        self.discard_where(key, lambda copy: P.digest_of(key, tensor_bytes(copy)) == digest)

    def discard_where(self, key: str, is_refused) -> None:
        """L1's copy, then each lower tier's copy that ``is_refused`` (or that its tier cannot read): a sealed
        object's payload is checked by the loader's MAC alone (codec FLAG_SEALED), so a byte changed in Redis reaches
        the loader -- the other tiers' copies may be intact, and the next read takes them (and checks them)."""
        self._remove([key], is_refused, wait=True)

    def discard_where_nowait(self, key: str, is_refused) -> Removal | None:
        return self._remove([key], is_refused, wait=False)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """True iff every write this thread enqueued since its previous flush reached every lower tier.

        False when one was dropped (queue full), failed in a tier, was skipped because a tier
        was down, or when the queued writes did not finish within ``timeout_s``. Losses are kept
        per writer thread, so one writer's flush never consumes another's report.
        """
        if not self.lower:
            return True
        if self._closed:                   # the worker wrote everything before it stopped
            return self._unreported_lost.pop(threading.get_ident(), 0) == 0
        marker = _Marker()
        return self._wait_queued(("flush", marker), timeout_s) and marker.ok

    def stats(self) -> StatsDict:
        out = self.l1.stats()
        with self._lock:
            tier_wt = {name: dict(c) for name, c in self._tier_wt.items()}
            out["writethrough"] = {**self._wt, "queued_bytes": self._queued_bytes,
                                   "queued_objects": self._queued_objects,
                                   "removals_queued": self._queued_removals,
                                   "removals_pending": self._pending.count,
                                   "removals_abandoned": self._pending.abandoned}
        for tier in self.lower:
            for name, counters in tier.stats().items():
                out[name] = {**counters, **self.health[tier.name].snapshot(), **tier_wt[tier.name]}
        return out

    def close(self) -> None:
        if self._closed:
            return
        if self.lower:
            with self._lock:               # a removal queued after "stop" would never run: _remove checks this
                self._stopping = True
                self._queue.put(("stop", None))
            self._worker.join(timeout=30.0)
        self._closed = True
        for tier in self.lower:
            tier.close()

    def _fill_from_lower(self, keys: list[str], out: list) -> list[int]:
        """Fill L1 misses in ``out`` from L2, then L3 (not keys being deleted); returns the indices filled."""
        filled: list[int] = []
        deleting, kept = self._being_deleted(keys)
        for tier in self.lower:
            hidden = kept.get(tier.name, ())
            missing = [i for i, t in enumerate(out) if t is None and keys[i] not in deleting and keys[i] not in hidden]
            if not missing and not any(t is None for t in out):
                break
            if not missing:
                continue
            found = self._read(tier, "get", [keys[i] for i in missing]) or []
            for i, tensor in zip(missing, found):
                if tensor is not None:
                    out[i] = tensor
                    filled.append(i)
        return filled

    # -- deletes: L1 now, the lower tiers behind the queued writes -------------------------

    def discards_nowait(self, refusals: list[tuple[str, object]]) -> list[Removal | None]:
        """``discard_where_nowait`` of each (key, is_refused), refused whole (``RemovalQueueFull``: nothing done) when
        the queued removals have no room for all of them -- the daemon's Discard of several keys."""
        keys = [check_key(key) for key, _ in refusals]
        if self.lower:
            self._reserve_removals(len(keys))
        done = []
        try:
            for key, is_refused in refusals:
                done.append(self._remove([key], is_refused, wait=False, reserved=True))
        except BaseException:
            if self.lower:                 # the one that raised gave its own key back; the rest were never queued
                self._unreserve(len(refusals) - len(done) - 1)
            raise
        return done

    def _remove(self, keys: list[str], is_refused=None, wait: bool = True, reserved: bool = False) -> Removal | None:
        """L1's copies of ``keys`` now; the lower tiers' by the worker, after every write queued before this (so
        none lands after it): all of them, or (``is_refused``: a discard) those that test refused. Meanwhile this
        store's reads miss ``keys`` in the lower tiers. ``wait``: until the worker is done, at most 30 s (a stalled
        tier: the removal still happens when it gets there). ``reserved``: the caller counted ``keys`` into the
        queued removals (``discards_nowait``). -> the Removal set once it is done (naming the tiers that were down
        for it); None when it is done already. A bad key raises before anything is done or counted."""
        keys = [check_key(key) for key in keys]      # ours: the caller may reuse its list once we return
        if not keys:                                  # (nothing to remove: nothing queued or held -- review 44)
            return None
        if self.lower and not reserved:
            self._reserve_removals(len(keys))
        try:
            self.l1.delete(keys)
        except BaseException:
            if self.lower:
                self._unreserve(len(keys))
            raise
        if not self.lower:
            return None
        marker = _Marker()
        with self._lock:                   # (against close(): queued before its "stop", or not at all)
            queued = not self._stopping
            if queued:
                for key in keys:
                    self._deleting[key] = self._deleting.get(key, 0) + 1
                self._queue.put(("remove", (keys, is_refused, marker)))
            else:
                self._queued_removals -= len(keys)     # (never queued: the worker will not give them back)
        if not queued:                     # closing: once the worker is done, nothing queued is left to overtake
            self._worker.join(timeout=30.0)
            self._remove_lower(keys, is_refused, keep=False)
            return None
        if wait:
            marker.done.wait(30.0)
        return marker.done

    def _reserve_removals(self, n: int) -> None:
        """Count ``n`` keys into the queued removals, or raise ``RemovalQueueFull`` (nothing done) when that would pass
        ``MAX_QUEUED_REMOVALS`` -- a removal cannot be dropped as a write is, so a stalled tier refuses new ones
        rather than queue without bound (an empty queue takes any one: a single Delete is at most a batch)."""
        with self._lock:
            if self._queued_removals and self._queued_removals + n > MAX_QUEUED_REMOVALS:
                raise RemovalQueueFull(f"{self._queued_removals} keys already queued for removal from "
                                       f"{', '.join(t.name for t in self.lower)}; limit {MAX_QUEUED_REMOVALS} "
                                       f"(this removal of {n} keys was not done; retry once they drain)")
            self._queued_removals += n

    def _unreserve(self, n: int) -> None:
        with self._lock:
            self._queued_removals -= n

    def _remove_lower(self, keys: list[str], is_refused, keep: bool = True) -> tuple[str, ...]:
        """Remove from each lower tier; ``keep``: what a tier misses is kept for it and retried (``_retry_pending``).
        -> the tiers that missed some of it."""
        out = []
        for tier in self.lower:
            missed = self._remove_in(tier, keys, is_refused)
            if missed is not None:
                out.append(tier.name)
            if keep and _outage(missed):     # (an up tier that refused it: not an outage. Decided by this call's
                #                               result, not by health.down: a reader's probe may have brought the
                #                               tier up since -- tests/test_review42_probe_race.py)
                fresh = [k for k in keys if self._pending.keep(tier.name, k, is_refused)]
                with self._lock:           # hidden from that tier only (the others did it: their newer objects
                    self._kept[tier.name].update(fresh)   # are served -- test_review42_hidden_across_tiers.py)
        return tuple(out)

    def _remove_in(self, tier: KVStore, keys: list[str], is_refused):
        """``keys`` out of ``tier`` (a discard: its copy only if ``is_refused``); -> None when done, else why it
        missed them: ``_DOWN`` (skipped), ``_FAILED`` (it raised: an outage) or ``_REFUSED`` (an up tier refused
        the request)."""
        if is_refused is None:
            return _why_missed(self._call(tier, "delete", keys))
        key, = keys
        copy = self._call(tier, "get", [key])
        if _missed(copy):
            return copy
        if copy[0] is not None and not is_refused(copy[0]):
            return None                    # another object: the next reader's (its seal is checked then)
        return _why_missed(self._call(tier, "delete", [key]))

    def _retry_pending(self) -> None:
        """The worker, before each op and every ``RETRY_S`` when idle: each tier's kept removals, once it takes calls
        again (one health check per tier; its deletes batched)."""
        for name in self._pending.tiers():
            tier = next(t for t in self.lower if t.name == name)
            if self.health[name].waiting():
                continue
            deletes = self._pending.deletes(name)
            for start in range(0, len(deletes), RETRY_BATCH):
                batch = deletes[start:start + RETRY_BATCH]
                if not self._retried(tier, batch, None):
                    break
            else:
                for key, is_refused in self._pending.discards(name):
                    if not self._retried(tier, [key], is_refused):
                        break

    def _retried(self, tier: KVStore, keys: list[str], is_refused) -> bool:
        """One retry of kept removals; False when the tier is down again (they stay kept). Done, refused by an up
        tier, or a refusal test that raised: settled (an up tier that refuses it would refuse it forever)."""
        try:
            missed = self._remove_in(tier, keys, is_refused)
        except Exception:  # noqa: BLE001 -- a refusal test that raised must not end the write-through worker
            log.exception("KV removal of %d keys kept for tier %s failed; dropped", len(keys), tier.name)
            missed = None
        if _outage(missed):                # (this call's result: see _remove_lower)
            return False
        self._settled(tier.name, keys)
        return True

    def _settled(self, tier: str, keys: list[str]) -> None:
        """``keys``' removals kept for ``tier`` are done or superseded: no longer hidden on its account."""
        done = self._pending.resolved(tier, keys)
        if done:
            with self._lock:
                self._kept[tier].difference_update(done)

    def _removed(self, keys: list[str], is_refused, marker: "_Marker") -> None:
        """The worker: one queued delete or discard."""
        try:
            marker.done.missed = self._remove_lower(keys, is_refused)
        except Exception:  # noqa: BLE001 -- a refusal test that raised must not end the write-through worker
            log.exception("KV removal of %d keys from the lower tiers failed", len(keys))
        finally:
            self._uncount(keys)
            marker.done.set()

    def _uncount(self, keys: list[str]) -> None:
        with self._lock:
            self._queued_removals -= len(keys)
            for key in keys:
                left = self._deleting.pop(key, 1) - 1
                if left > 0:
                    self._deleting[key] = left

    def _being_deleted(self, keys: list[str]) -> tuple[set[str], dict[str, set[str]]]:
        """-> (keys every lower tier must miss: queued removals, {tier: keys that tier must miss: kept removals})."""
        if not self._deleting and not any(self._kept.values()):    # (the common case: no lock)
            return set(), {}
        with self._lock:
            return ({k for k in keys if k in self._deleting},
                    {t: {k for k in keys if k in kept} for t, kept in self._kept.items() if kept})

    # -- write-through: callers enqueue, one worker thread writes ---------------------------

    def _enqueue(self, items: Items, release=None) -> None:
        """``release``: called once the lower tiers are done with the items' bytes (or the batch is dropped)."""
        if not self.lower or not items:
            return
        nbytes = sum(t.numel() * t.element_size() for _, t in items)
        with self._lock:                   # the queue order is the accounting order
            writer = threading.get_ident()
            if self._queued_objects and self._queued_bytes + nbytes > self.queue_bytes:
                self._drop(len(items), nbytes)
                self._queue.put(("dropped", (len(items), writer)))
                if release is not None:
                    release()
                return
            self._end_full_episode()
            self._queued_bytes += nbytes
            self._queued_objects += len(items)
            self._queue.put(("put", (items, nbytes, writer, release)))

    def _drop(self, n: int, nbytes: int) -> None:
        """Count a dropped batch (lock held); WARNING once per full episode."""
        if not self._episode_dropped:
            log.warning("KV write-through queue full (%d bytes in %d objects queued, limit %d; "
                        "--kv-writethrough-queue-bytes): dropping writes to %s until it drains "
                        "(first drop: %d objects, %d bytes); counted in writethrough.dropped",
                        self._queued_bytes, self._queued_objects, self.queue_bytes,
                        ", ".join(t.name for t in self.lower), n, nbytes)
        self._episode_dropped += n
        self._wt["dropped"] += n
        self._wt["lost"] += n

    def _end_full_episode(self) -> None:
        if self._episode_dropped:
            log.info("KV write-through queue accepts writes again; %d objects were dropped while it was full",
                     self._episode_dropped)
            self._episode_dropped = 0

    def _wait_queued(self, marker_op: tuple, timeout_s: float = 30.0) -> bool:
        """Queue a marker behind every write queued so far; True once the worker reached it."""
        if not self.lower or self._closed:
            return True
        self._queue.put(marker_op)
        return marker_op[1].done.wait(timeout_s)

    def _write_loop(self) -> None:
        while True:
            try:
                op, arg = self._queue.get(timeout=RETRY_S if self._pending.count else None)
            except queue.Empty:
                self._retry_pending()
                continue
            if self._pending.count:
                self._retry_pending()
            if op == "stop":
                self._pending.abandon_all()
                with self._lock:
                    for kept in self._kept.values():
                        kept.clear()
                return
            if op == "put":
                self._write_batch(*arg)
            elif op == "dropped":
                self._count_lost(*arg)
            elif op == "remove":
                self._removed(*arg)
            else:                          # "flush": reports and resets its writer's losses
                arg.ok = self._unreported_lost.pop(arg.writer, 0) == 0
                arg.done.set()

    def _count_lost(self, n: int, writer: int) -> None:
        self._unreported_lost[writer] = self._unreported_lost.get(writer, 0) + n

    def _write_batch(self, items: Items, nbytes: int, writer: int, release) -> None:
        outcomes = [self._write_to(tier, items) for tier in self.lower]
        if release is not None:
            release()
        if self._pending.count:            # a newer object in a tier voids the removal kept for its older one there
            for tier, outcome in zip(self.lower, outcomes):
                if outcome == "wt_written":
                    self._settled(tier.name, [key for key, _ in items])
        lost = any(o != "wt_written" for o in outcomes)
        with self._lock:
            for tier, outcome in zip(self.lower, outcomes):
                self._tier_wt[tier.name][outcome] += len(items)
            self._queued_bytes -= nbytes
            self._queued_objects -= len(items)
            self._wt["lost"] += len(items) if lost else 0
        if lost:
            self._count_lost(len(items), writer)

    def _write_to(self, tier: KVStore, items: Items) -> str:
        """The outcome's counter name: wt_written, wt_failed (the tier raised) or wt_skipped_down."""
        result = self._call(tier, "put", items)
        return "wt_skipped_down" if result is _DOWN else "wt_failed" if _missed(result) else "wt_written"

    def _read(self, tier: KVStore, method: str, arg):
        """``tier.method(arg)``, or None when the tier is down or failed."""
        result = self._call(tier, method, arg)
        return None if _missed(result) else result

    def _call(self, tier: KVStore, method: str, arg):
        """``tier.method(arg)`` if the tier is up; _DOWN when skipped, _FAILED when it raised, _REFUSED when it
        raised ValueError (the request refused: not an outage)."""
        health = self.health[tier.name]
        if not health.available():
            return _DOWN
        try:
            result = getattr(tier, method)(arg)
        except ValueError as exc:  # the object cannot be stored there (dtype, dims): not an outage
            health.release()
            log.warning("KV tier %s refused %s: %s", tier.name, method, exc)
            return _REFUSED
        except Exception as exc:  # noqa: BLE001 - any backend failure marks the tier down
            health.failed(exc)
            return _FAILED
        health.ok()
        return result


class _Marker:
    """A flush, delete or discard in the write-through queue; the worker sets ``done`` once it has done it."""

    def __init__(self) -> None:
        self.done = Removal()
        self.ok = False
        self.writer = threading.get_ident()      # whose losses a flush marker reports


_DOWN, _FAILED, _REFUSED = object(), object(), object()


def _missed(result) -> bool:
    return result is _DOWN or result is _FAILED or result is _REFUSED


def _why_missed(result):
    """``_call``'s result -> the sentinel that says why it missed, or None when it went through."""
    return result if _missed(result) else None


def _outage(missed) -> bool:
    """A removal missed for an outage (skipped as down, or the tier raised): kept for the tier and retried."""
    return missed is _DOWN or missed is _FAILED
