"""The proxy's Prometheus metrics, in a registry of its own (served by ``app`` at /metrics).

Updated by ``router`` (in-flight, health), ``orchestrate`` (retries, aborted calls, phase latency, P/D decisions),
``app`` (requests by outcome, end-to-end latency), ``kv_routing`` (store lookups) and ``kv_events`` (events, cached
blocks per node).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ProxyMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_proxy_requests", "client requests by endpoint and outcome "
                                "(ok, client_error, busy, upstream_error, no_node, aborted, stream_error)",
                                ["endpoint", "outcome"], registry=r)
        self.retries = Counter("pdserve_proxy_retries", "node calls retried on another node, by role",
                               ["role"], registry=r)
        self.aborted_calls = Counter("pdserve_proxy_aborted_calls", "node calls failed by the proxy because the "
                                     "probes took their silent node out of rotation, by role", ["role"], registry=r)
        self.in_flight = Gauge("pdserve_proxy_node_in_flight", "requests open on each node",
                               ["role", "node"], registry=r)
        self.healthy = Gauge("pdserve_proxy_node_healthy", "1 when the node's last /health probe passed",
                             ["role", "node"], registry=r)
        self.latency = Histogram("pdserve_proxy_request_latency_seconds", "client request, arrival to last byte",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.phase_latency = Histogram("pdserve_proxy_phase_latency_seconds",
                                       "time per phase: prefill (the prefill calls), decode_first_byte (decode "
                                       "call until its first byte), decode (the decode call to its last byte)",
                                       ["phase"], buckets=_LATENCY_BUCKETS, registry=r)

        self.pd_decisions = Counter("pdserve_proxy_pd_decisions", "requests by P/D decision: prefill (prefill node, "
                                    "then decode node), store_hit (the store holds all but the last block: decode "
                                    "node only), decode_local (the uncached part is under --local-prefill-threshold: "
                                    "decode node only)", ["decision"], registry=r)
        self.store_lookups = Counter("pdserve_proxy_store_lookups", "the proxy's store lookups by outcome (hit, miss, "
                                     "error, skipped: the store failed lately or is busy)", ["outcome"], registry=r)
        self.store_hit_tokens = Counter("pdserve_proxy_store_hit_tokens", "prompt tokens the store held at routing",
                                        registry=r)
        self.kv_events = Counter("pdserve_proxy_kv_events", "KV-event batches from the nodes by outcome (accepted, "
                                 "reset: accepted after forgetting the node's state, stale: a replayed epoch or "
                                 "sequence, forged: bad MAC or malformed; replayed: a node's whole set read from its "
                                 "replay socket, or a batch it already held; replay_failed; refused: a node's socket "
                                 "refused the proxy's CURVE handshake (another cluster token), once per run of "
                                 "refusals)", ["outcome"], registry=r)
        self.node_cached_blocks = Gauge("pdserve_proxy_node_cached_blocks", "blocks a node's KV events say its prefix "
                                        "cache holds", ["role", "node"], registry=r)
        self.redis_prefix_mismatch = Gauge("pdserve_proxy_kv_redis_prefix_mismatch", "1 when a node's card names "
                                           "another Redis key prefix than the proxy's --kv-redis-prefix (its store "
                                           "lookups all miss)", ["role", "node"], registry=r)

        for role in ("prefill", "decode"):     # exported at 0 from the start (vLLM pre-creates its labels too)
            self.retries.labels(role)
            self.aborted_calls.labels(role)

    def render(self) -> bytes:
        return generate_latest(self.registry)
