"""Removals a lower tier missed (it was down, or it raised): kept per tier, retried by the write-through worker.

Who calls it: ``TieredStore`` (tiered.py), from its write-through worker thread only -- nothing here is locked; the
store hides each kept (tier, key) from that tier's reads (``TieredStore._kept``; the other tiers did the removal)
until the removal is done, superseded or abandoned.

    a delete/discard misses tier T ──> keep(T, key) ──> T takes calls again: one batched delete (``deletes``), each
                                                        discard's test on T's copy (``discards``) ──> resolved
                                       a later write of key reaches T ──> superseded (the newer object stays)
                                       MAX_KEYS kept for T, or the store closes ──> abandoned (counted, logged)

A delete outranks a discard of the same key (``keep``). The worker asks the tier's health once per tier, not per key,
so a long outage costs each queued op one check (tests/test_review_held_retry_growth.py).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
MAX_KEYS = 100_000          # removals kept per tier; past it a missed removal is abandoned (its object may come back)
_MISSING = object()


class PendingRemovals:
    def __init__(self, tiers: list[str]) -> None:
        self._by_tier: dict[str, dict[str, object]] = {t: {} for t in tiers}   # key -> refusal test, None: delete
        self.count = 0              # kept, all tiers
        self.abandoned = 0

    def keep(self, tier: str, key: str, is_refused) -> bool:
        """Keep ``key``'s removal for ``tier``; True when it is newly kept there (the caller hides the key from
        that tier), False when it already was (merged) or the tier's list is full (abandoned, logged)."""
        pending = self._by_tier[tier]
        if key in pending:
            if is_refused is None:
                pending[key] = None
            return False
        if len(pending) >= MAX_KEYS:
            if not self.abandoned:
                log.warning("KV tier %s missed %d removals while down; past that they are not retried (their objects "
                            "may be served again once it is back): counted in writethrough.removals_abandoned",
                            tier, MAX_KEYS)
            self.abandoned += 1
            return False
        pending[key] = is_refused
        self.count += 1
        return True

    def tiers(self) -> list[str]:
        return [t for t, pending in self._by_tier.items() if pending]

    def deletes(self, tier: str) -> list[str]:
        return [k for k, test in self._by_tier[tier].items() if test is None]

    def discards(self, tier: str) -> list[tuple[str, object]]:
        return [(k, test) for k, test in self._by_tier[tier].items() if test is not None]

    def resolved(self, tier: str, keys: list[str]) -> list[str]:
        """``keys``' removals on ``tier`` are done, or void (a later write of them reached it); -> those that were
        kept (the caller stops hiding them from that tier)."""
        pending = self._by_tier[tier]
        if not pending:
            return []
        done = [k for k in keys if pending.pop(k, _MISSING) is not _MISSING]
        self.count -= len(done)
        return done

    def abandon_all(self) -> list[str]:
        """Every kept removal, dropped (the store closes): -> their keys, one per (tier, key)."""
        keys = [k for pending in self._by_tier.values() for k in pending]
        if keys:
            log.warning("KV store closing with %d removals its lower tiers missed while down (%s): not retried; "
                        "those objects may be served again", len(keys), ", ".join(self.tiers()))
        for pending in self._by_tier.values():
            pending.clear()
        self.abandoned += len(keys)
        self.count = 0
        return keys
