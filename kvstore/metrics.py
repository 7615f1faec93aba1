"""Prometheus export of the store's counters.

Who calls it: the node's ``/metrics`` endpoint (mounts ``StoreCollector`` on its
registry), the daemon's ``stats`` reply feeds the same names. Every counter of every
tier becomes ``pdserve_kvstore_<counter>{tier="memory|redis|disk|writethrough|..."}``,
read from ``store.stats()`` at scrape time (no second set of counters to drift).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.kvstore.base import KVStore, StatsDict

PREFIX = "pdserve_kvstore_"


class StoreCollector(Collector):
    def __init__(self, store: KVStore) -> None:
        self.store = store

    def collect(self):
        return families(self.store.stats())


def families(stats: StatsDict) -> list[GaugeMetricFamily]:
    """One gauge family per counter name, one sample per tier."""
    by_name: dict[str, GaugeMetricFamily] = {}
    for tier, counters in sorted(stats.items()):
        for counter, value in sorted(counters.items()):
            family = by_name.get(counter)
            if family is None:
                family = GaugeMetricFamily(PREFIX + counter, f"KV store {counter} per tier", labels=["tier"])
                by_name[counter] = family
            family.add_metric([tier], float(value))
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
