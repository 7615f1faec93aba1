"""Prometheus metrics of one node, in a registry private to its app (``GET /metrics``), under vLLM's names.

Names, types, units, buckets and labels (``model_name``, ``engine``) are vLLM's (``vllm/v1/metrics/loggers.py``,
``PrometheusStatLogger``), so dashboards and alerts written for vLLM read a pdserve node as they are; the README's
metrics table says which vLLM metric maps to what, which do not apply and why, and what pdserve adds
(``pdserve_*``, LMCache's ``lmcache:*`` for the KV store's load and publish). ``tests/data/vllm_metrics.json``
is the list the tests check this against.

Two sources:
- engine state, read at scrape time from ``engine.stats()`` (``EngineStatsCollector``, ``metrics_engine.py``):
  running / waiting, KV usage, prefix cache, preemptions, tokens per step, KV accounting and the store's tiers;
- per-request figures, recorded by ``generation.py`` through a ``RequestTracker`` (``request_metrics.py``) for
  every engine request: TTFT and ITL as outputs arrive, then at the end the engine core's ``RequestTimes``
  (queue / prefill / decode / inference, KV load and publish), token counts and the finish reason.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pdserve.engine.server.metrics_engine import EngineStatsCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE = "0"                          # vLLM's ``engine`` label: the engine index; a pdserve node has one engine
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
# LMCache's buckets of lmcache:time_to_retrieve / lmcache:time_to_store
KV_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, engine, model_name: str, max_model_len: int | None = None):
        self.registry = r = CollectorRegistry()
        r.register(EngineStatsCollector(engine, model_name, ENGINE))
        vllm_labels, lm_labels = ["model_name", "engine"], ["model_name", "worker_id"]
        mine, lm = {"model_name": model_name, "engine": ENGINE}, {"model_name": model_name, "worker_id": ENGINE}
        counts = build_1_2_5_buckets(max_model_len or getattr(engine, "max_model_len", 1 << 20))

        def hist(name: str, doc: str, buckets, labels=vllm_labels, values=mine) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**values)

        def counter(name: str, doc: str, labels=vllm_labels, values=mine) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(**values)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                          REQUEST_LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prompt_len = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", counts)
        self.generation_len = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", counts)
        self.max_tokens = hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                               counts)
        self.max_generation = hist("vllm:request_max_num_generation_tokens",
                                   "Histogram of maximum number of requested generation tokens.", counts)
        self.n = hist("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*vllm_labels, "finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, ENGINE, reason) for reason in FINISH_REASONS}
        self.kv_load = hist("lmcache:time_to_retrieve", "Time to retrieve KV from the store (seconds): a request's "
                            "load, start to its last chunk in the cache", KV_TIME_BUCKETS, lm_labels, lm)
        self.kv_publish = hist("lmcache:time_to_store", "Time to store KV (seconds): a request's publish, first "
                               "chunk handed to the store to the last acknowledged", KV_TIME_BUCKETS, lm_labels, lm)
        self.retrieve_requests = counter("lmcache:num_retrieve_requests", "Requests that loaded KV from the store",
                                         lm_labels, lm)
        self.store_requests = counter("lmcache:num_store_requests", "Requests that published KV to the store",
                                      lm_labels, lm)
        self.kv_loaded_bytes = counter("pdserve_kv_loaded_bytes", "KV bytes loaded from the store into the KV cache",
                                       ["model_name"], {"model_name": model_name})
        self.kv_published_bytes = counter("pdserve_kv_published_bytes", "KV bytes handed to the store by publishes "
                                          "that completed", ["model_name"], {"model_name": model_name})

    def finished(self, reason: str) -> None:
        counter = self.success.get(reason)
        if counter is not None:
            counter.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
