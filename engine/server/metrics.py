"""Prometheus metrics of one node, in a registry private to its app (``GET /metrics``).

Two sources:
- engine state, read at scrape time from ``engine.stats()`` by ``_EngineStatsCollector``:
  running / waiting requests, KV usage, prefix-cache queries and hits (tokens), the KV
  connector's and the attached store's stats (gauges vs counters as ``pdserve.kvstore.metrics``
  classifies them: ``pdserve_kvstore_bytes`` is a gauge, ``pdserve_kvstore_hits_total`` a counter);
- per-request timings and counts, recorded by ``generation.py`` through a ``RequestTracker``
  for every engine request: TTFT, inter-token latency, end-to-end latency, prompt and
  generation tokens, finished requests by reason (stop, length, abort, error).

Names follow vLLM's (``vllm:num_requests_running`` -> ``pdserve_num_requests_running``), each
with a ``model_name`` label so that a proxy can scrape several nodes into one view.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.kvstore import metrics as store_metrics

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(engine, model_name))
        label = {"model_name": model_name}

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=self.registry).labels(**label)

        self.ttft = hist("pdserve_time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self.itl = hist("pdserve_inter_token_latency_seconds", "Time between consecutive tokens", _ITL_BUCKETS)
        self.e2e = hist("pdserve_e2e_request_latency_seconds", "Request latency, arrival to last token",
                        _E2E_BUCKETS)
        self.prompt_tokens = counter("pdserve_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("pdserve_generation_tokens", "Generated tokens")
        self._finished = Counter("pdserve_request_success", "Finished requests by finish reason",
                                 ["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name

    def finished(self, reason: str) -> None:
        self._finished.labels(model_name=self._model_name, finished_reason=reason).inc()

    def track(self, arrival: float) -> RequestTracker:
        return RequestTracker(self, arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Timings of one engine request; ``on_output`` per delta, ``on_end`` exactly once."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self._m, self._arrival, self._last = metrics, arrival, None
        self._num_prompt_tokens = 0
        self.ended = False

    def on_output(self, num_new_tokens: int, num_prompt_tokens: int) -> None:
        self._num_prompt_tokens = num_prompt_tokens
        if not num_new_tokens:
            return
        now = time.monotonic()
        if self._last is None:
            self._m.ttft.observe(now - self._arrival)
        else:
            self._m.itl.observe((now - self._last) / num_new_tokens)
        self._last = now
        self._m.generation_tokens.inc(num_new_tokens)

    def on_end(self, reason: str) -> None:
        if self.ended:
            return
        self.ended = True
        self._m.finished(reason)
        self._m.prompt_tokens.inc(self._num_prompt_tokens)
        self._m.e2e.observe(time.monotonic() - self._arrival)


class _EngineStatsCollector(Collector):
    """Reads ``engine.stats()`` once per scrape."""

    def __init__(self, engine, model_name: str):
        self._engine, self._model_name = engine, model_name

    def collect(self):
        stats = self._engine.stats()
        labels = [self._model_name]
        yield _gauge("pdserve_num_requests_running", "Requests in the running batch", stats.num_running, labels)
        yield _gauge("pdserve_num_requests_waiting", "Requests waiting to be scheduled", stats.num_waiting, labels)
        yield _gauge("pdserve_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)",
                     stats.kv_usage, labels)
        yield _counter("pdserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                       stats.prefix_cache_queries, labels)
        yield _counter("pdserve_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                       stats.prefix_cache_hits, labels)
        yield _gauge("pdserve_kv_cache_free_blocks", "Free KV blocks (cached-but-free included)",
                     stats.num_free_blocks, labels)
        yield _gauge("pdserve_kv_cache_num_blocks", "KV blocks in the cache", stats.num_blocks, labels)
        yield from _kv_transfer_families(stats, labels)


def _kv_transfer_families(stats, labels: list[str]):
    """KV accounting (tokens, summed over finished requests), the connector's and the store's stats.

    Connector and store stats are gauges or counters as ``pdserve.kvstore.metrics`` classifies
    them (``bytes`` is a level, ``hits`` an event count): one classification for every exporter.
    """
    for name, value in sorted(stats.kv_totals.items()):
        yield _counter(f"pdserve_kv_{name}", f"KV accounting: {name.replace('_', ' ')}, summed over requests",
                       value, labels)
    for name, value in sorted(stats.kv_transfer.items()):
        family = store_metrics.family(name, f"pdserve_kv_transfer_{name}",
                                      f"KV connector: {name.replace('_', ' ')}", ["model_name"])
        family.add_metric(labels, value)
        yield family
    if stats.kv_store:
        yield from store_metrics.families(stats.kv_store, {"model_name": labels[0]})


def _gauge(name: str, doc: str, value: float, labels: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def _counter(name: str, doc: str, value: float, labels: list[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family
