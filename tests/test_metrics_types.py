"""Store and connector stats are exported as gauges (levels) or counters (event counts) by the one
classification in ``pdserve.kvstore.metrics``, on a node's /metrics and a standalone store's alike,
so that ``bench/scrape.py``'s deltas of every ``*_total`` never go negative.

No node process: the node's exporter (``ServerMetrics``) reads a fake engine's stats whose
``kv_store`` is a real TieredStore (memory + disk).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.scrape import counter_delta, parse_counters
from pdserve.engine.server.metrics import ServerMetrics
from pdserve.kvstore import metrics as store_metrics
from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore

DAEMON = {"requests": 7, "errors": 0, "shm_clients": 2}             # KVDaemon._counters
CONNECTOR = {"load_failures": 0, "publish_failures": 1, "load_integrity_failures": 0,
             "load_digest_mismatches": 0, "publish_skipped": 0,
             **{f"store_{k}": v for k, v in TierHealth("store").snapshot().items()}}


@pytest.fixture
def store(tmp_path):
    s = TieredStore(MemoryTier(3000), [DiskTier(tmp_path, 1 << 20)])
    s.put([(f"k{i}", torch.zeros(250)) for i in range(3)])          # 3 x 1000 bytes: L1 full
    s.get(["k0", "absent"])
    assert s.flush()
    yield s
    s.close()


def _node_text(store) -> str:
    engine = SimpleNamespace(stats=lambda: SimpleNamespace(
        num_running=0, num_waiting=0, kv_usage=0.0, prefix_cache_queries=0, prefix_cache_hits=0,
        kv_totals={"total_tokens": 10}, kv_transfer=CONNECTOR, num_free_blocks=8, num_blocks=8,
        kv_store={**store.stats(), "daemon": DAEMON}, num_preemptions=0, iteration_tokens=[], iteration_tokens_sum=0))
    return ServerMetrics(engine, "m").render().decode()


def _types(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_every_reported_stat_name_is_classified(store):
    names = {n for tier in store.stats().values() for n in tier} | set(DAEMON) | set(CONNECTOR)
    assert names - store_metrics.GAUGES - store_metrics.COUNTERS == set()
    assert store_metrics.GAUGES & store_metrics.COUNTERS == set()


@pytest.mark.parametrize("source", ["node", "standalone"])
def test_levels_are_gauges_and_event_counts_are_counters(store, source):
    """Catches: the node exported every store stat as a counter (``pdserve_kvstore_bytes_total``,
    ``pdserve_kv_transfer_store_down_total``) and the standalone collector exported every one as a gauge."""
    text = _node_text(store) if source == "node" else store_metrics.render(store).decode()
    types = _types(text)
    prefixes = ("pdserve_kvstore_", "pdserve_kv_transfer_") if source == "node" else ("pdserve_kvstore_",)
    checked = 0
    for name, kind in types.items():
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is not None:
            assert kind == store_metrics.metric_kind(name[len(prefix):]), name
            checked += 1
    assert checked >= 20
    assert types["pdserve_kvstore_bytes"] == "gauge" and types["pdserve_kvstore_hits"] == "counter"
    for gauge in store_metrics.GAUGES:
        assert f"pdserve_kvstore_{gauge}_total" not in text and f"pdserve_kv_transfer_{gauge}_total" not in text
    assert 'pdserve_kvstore_hits_total{' in text and 'pdserve_kvstore_bytes{' in text


def test_bench_counter_deltas_stay_non_negative_when_levels_fall(store):
    """Catches: bench/scrape.py took deltas of store levels exported as counters; bytes falling
    after a delete gave negative 'counter' deltas in the bench's KV block."""
    before = parse_counters(_node_text(store))
    store.delete(["k0", "k1", "k2"])                                # levels fall: bytes 3000 -> 0
    store.put([("k3", torch.zeros(250))])
    store.get(["k3"])
    assert store.flush()
    delta = counter_delta(before, parse_counters(_node_text(store)))
    assert "pdserve_kvstore_bytes_total" not in delta and "pdserve_kvstore_objects_total" not in delta
    assert all(v >= 0 for v in delta.values()), {k: v for k, v in delta.items() if v < 0}
    assert delta["pdserve_kvstore_hits_total"] == 1 and delta["pdserve_kvstore_wt_written_total"] == 1


def test_every_name_a_real_daemon_and_client_report_is_classified():
    """Names come from a live daemon and a DaemonClient (shm and frames), not from a list typed here.

    Mutation caught: a client/daemon counter (``timeouts``, ``shm_reclaimed`` ...) missing from
    COUNTERS -> exported as a gauge (the review found seven).
    """
    from kvstore_fixtures import DaemonProcess
    from pdserve.kvstore.client import DaemonClient

    daemon = DaemonProcess("--log-level", "WARNING")
    try:
        for shm in (1 << 20, 0):
            client = DaemonClient(daemon.url, shm_bytes=shm)
            try:
                client.put([("a:0", torch.zeros(8))])
                assert client.get(["a:0", "b:0"])[1] is None
                stats = client.stats()
            finally:
                client.close()
            names = {n for tier in stats.values() for n in tier}
            assert {"daemon", "client", "memory"} <= set(stats)
            assert names - store_metrics.GAUGES - store_metrics.COUNTERS == set(), names
    finally:
        daemon.stop()
