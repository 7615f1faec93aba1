"""The node's scrape-time metrics: read from ``engine.stats()`` once per ``GET /metrics``.

Called by the node's registry (``metrics.ServerMetrics``). ``engine.stats()`` is the engine thread's figures, or
the engine-core process's last report (``CoreOutputs.stats``, at most ``STATS_INTERVAL_S`` old). vLLM's names:

    vllm:num_requests_running / _waiting, vllm:kv_cache_usage_perc            gauges
    vllm:prefix_cache_queries_total / _hits_total (tokens), vllm:num_preemptions_total   counters
    vllm:external_prefix_cache_queries_total / _hits_total (the KV store: accounting's total / need_to_load tokens)
    vllm:iteration_tokens_total                                              histogram (tokens per engine step)

and pdserve's own: ``pdserve_kv_cache_free_blocks`` / ``_num_blocks``, the KV accounting per request
(``pdserve_kv_*_tokens_total``: total = local hit + loaded + recomputed), the KV connector's counters and the
store's per tier (gauges or counters as ``pdserve.kvstore.metrics`` classifies them).
"""

from __future__ import annotations

from itertools import accumulate

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from pdserve.engine.outputs import ITERATION_TOKEN_BUCKETS
from pdserve.kvstore import metrics as store_metrics

_VLLM = ["model_name", "engine"]


class EngineStatsCollector(Collector):
    def __init__(self, engine, model_name: str, engine_index: str):
        self._engine, self._model_name, self._index = engine, model_name, engine_index

    def collect(self):
        stats = self._engine.stats()
        v, mine = [self._model_name, self._index], [self._model_name]
        yield _family(GaugeMetricFamily, "vllm:num_requests_running",
                      "Number of requests in model execution batches.", stats.num_running, v)
        yield _family(GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                      stats.num_waiting, v)
        yield _family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                      stats.kv_usage, v)
        yield _family(CounterMetricFamily, "vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", stats.prefix_cache_queries, v)
        yield _family(CounterMetricFamily, "vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits, v)
        yield _family(CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      stats.num_preemptions, v)
        yield _family(CounterMetricFamily, "vllm:external_prefix_cache_queries",      # the KV store: vLLM's
                      "External prefix cache queries from KV connector cross-instance cache sharing, in terms of "
                      "number of queried tokens.", stats.kv_totals.get("total_tokens", 0), v)
        yield _family(CounterMetricFamily, "vllm:external_prefix_cache_hits",         # need_to_load: vLLM's
                      "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
                      "number of cached tokens.", stats.kv_totals.get("need_to_load_tokens", 0), v)
        yield _iteration_tokens(stats, v)
        yield _family(GaugeMetricFamily, "pdserve_kv_cache_free_blocks", "Free KV blocks (cached-but-free included)",
                      stats.num_free_blocks, mine, ["model_name"])
        yield _family(GaugeMetricFamily, "pdserve_kv_cache_num_blocks", "KV blocks in the cache", stats.num_blocks,
                      mine, ["model_name"])
        yield from _kv_transfer_families(stats, mine)


def _iteration_tokens(stats, labels: list[str]) -> HistogramMetricFamily:
    family = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                   labels=_VLLM)
    counts = stats.iteration_tokens or [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    cumulative = list(accumulate(counts))
    bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
    family.add_metric(labels, list(zip(bounds, cumulative)), stats.iteration_tokens_sum)
    return family


def _kv_transfer_families(stats, labels: list[str]):
    """KV accounting (tokens, summed over finished requests), the connector's and the store's stats.

    Connector and store stats are gauges or counters as ``pdserve.kvstore.metrics`` classifies
    them (``bytes`` is a level, ``hits`` an event count): one classification for every exporter.
    """
    for name, value in sorted(stats.kv_totals.items()):
        yield _family(CounterMetricFamily, f"pdserve_kv_{name}",
                      f"KV accounting: {name.replace('_', ' ')}, summed over requests", value, labels, ["model_name"])
    for name, value in sorted(stats.kv_transfer.items()):
        family = store_metrics.family(name, f"pdserve_kv_transfer_{name}",
                                      f"KV connector: {name.replace('_', ' ')}", ["model_name"])
        family.add_metric(labels, value)
        yield family
    if stats.kv_store:
        yield from store_metrics.families(stats.kv_store, {"model_name": labels[0]})


def _family(kind, name: str, doc: str, value: float, values: list[str], names: list[str] = _VLLM):
    family = kind(name, doc, labels=names)
    family.add_metric(values, value)
    return family
