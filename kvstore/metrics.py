"""Prometheus export of the store's stats, and the one gauge/counter classification of their names.

Who calls it: the node's ``/metrics`` (``engine/server/metrics.py`` calls ``families`` with a
``model_name`` label, and ``metric_kind`` for the KV connector's names), a standalone store
(``render``), tests. Every stat of every tier becomes one sample with a ``tier`` label
(memory | redis | disk | writethrough | daemon), read from ``store.stats()`` at scrape time:

    level (GAUGES)       -> gauge    pdserve_kvstore_bytes{tier="memory"}
    event count (COUNTERS) -> counter  pdserve_kvstore_hits_total{tier="memory"}

Counters only ever grow, so a scraper (``bench/scrape.py``) may take deltas of every
``*_total``; a level exported as a counter would give negative deltas. A name in neither
set is exported as a gauge (never delta'd) and logged once: add it to one set here.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.kvstore.base import KVStore, StatsDict

log = logging.getLogger(__name__)
PREFIX = "pdserve_kvstore_"

GAUGES = frozenset({
    "objects", "bytes", "pinned",                       # TierStats levels, MemoryTier
    "down", "consecutive_failures",                     # TierHealth
    "queued_bytes", "queued_objects",                   # TieredStore write-through queue
    "removals_pending",                                 # TieredStore: removals kept for a tier that missed them
    "removals_queued",                                  # TieredStore: keys in queued deletes/discards
    "shm_clients", "arena_clients",                     # KVDaemon
    "arena_free_bytes", "frame_bytes",                  # ArenaTier (the daemon's L1 arena; frame-backed slots)
    "store_down", "store_consecutive_failures",         # KV connector's store health
    "publish_buffer_bytes", "publish_buffer_bytes_in_flight", "publish_buffer_peak_bytes",   # publish ring
})
COUNTERS = frozenset({
    "hits", "misses", "evictions", "bytes_in", "bytes_out", "errors", "checksum_failures",
    "key_mismatch", "rejected",                         # TierStats events
    "marked_down",                                      # TierHealth
    "wt_written", "wt_failed", "wt_skipped_down",       # TieredStore, per lower tier (objects)
    "dropped", "lost", "removals_abandoned",            # TieredStore write-through (objects; removals not retried)
    "requests", "shm_reclaimed", "shm_refused", "sends_copied",   # KVDaemon (sends_copied: replies past the pin cap)
    "arena_reserved", "arena_committed", "arena_cancelled", "arena_leased", "arena_expired",   # KVDaemon's arena
    "timeouts", "arena_maps", "shm_attaches", "shm_abandoned", "shm_objects", "frame_objects",   # DaemonClient
    "daemon_auth_failures",                             # DaemonClient: the peer could not prove the key
    "load_failures", "publish_failures", "load_integrity_failures", "load_digest_mismatches",
    "publish_skipped", "store_marked_down",             # KV connector
    "publish_buffer_waits", "publish_buffer_wait_seconds", "publish_buffer_skips",   # publish ring
    "load_layerwise_batches", "load_layerwise_wait_seconds",   # --kv-load-layerwise: steps, time the model waited
})
_warned: set[str] = set()


def metric_kind(name: str) -> str:
    """``"gauge"`` for a level, ``"counter"`` for an event count; unknown names are gauges (logged once)."""
    if name in COUNTERS:
        return "counter"
    if name not in GAUGES and name not in _warned:
        _warned.add(name)
        log.warning("KV stat %r is neither in GAUGES nor COUNTERS (kvstore/metrics.py); exported as a gauge", name)
    return "gauge"


def family(stat: str, metric_name: str, doc: str, labels: list[str]) -> Metric:
    """An empty gauge or counter family (as ``metric_kind(stat)``); a counter is exposed as ``*_total``."""
    kind = CounterMetricFamily if metric_kind(stat) == "counter" else GaugeMetricFamily
    return kind(metric_name, doc, labels=labels)


class StoreCollector(Collector):
    def __init__(self, store: KVStore) -> None:
        self.store = store

    def collect(self):
        return families(self.store.stats())


def families(stats: StatsDict, extra: dict[str, str] | None = None) -> list[Metric]:
    """One family per stat name, one sample per tier; ``extra`` labels go before ``tier``."""
    extra = extra or {}
    by_name: dict[str, Metric] = {}
    for tier, counters in sorted(stats.items()):
        for stat, value in sorted(counters.items()):
            fam = by_name.get(stat)
            if fam is None:
                fam = by_name[stat] = family(stat, PREFIX + stat, f"KV store {stat} per tier", [*extra, "tier"])
            fam.add_metric([*extra.values(), tier], float(value))
    return list(by_name.values())


def register_store(store: KVStore, registry: CollectorRegistry) -> StoreCollector:
    collector = StoreCollector(store)
    registry.register(collector)
    return collector


def render(store: KVStore) -> bytes:
    """Prometheus text for one store (what a standalone /metrics would serve)."""
    registry = CollectorRegistry()
    register_store(store, registry)
    return generate_latest(registry)
