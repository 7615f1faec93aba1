"""Writes pdserve-disagg.json, the Grafana dashboard of a disaggregated pdserve cluster: ``python make_dashboard.py``.

The JSON is committed; this script is how it is edited (panels as data, one place for the layout).
``tests/test_observability.py`` checks that every metric its PromQL names is exported by a running cluster.
"""

from __future__ import annotations

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "${datasource}"}
M = '{model_name=~"$model_name"}'
Q = (0.5, 0.9, 0.99)


def quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    legend = f"p{{q}}{' {{' + by + '}}' if by else ''}"
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{M}[$__rate_interval])))",
             legend.format(q=int(q * 100))) for q in Q]


PANELS = [
    ("Requests", [
        ("Request rate at the proxy (req/s, by outcome)", "reqps",
         [('sum by (outcome) (rate(pdserve_proxy_requests_total[$__rate_interval]))', "{{outcome}}")]),
        ("Finished requests per node (req/s, by reason)", "reqps",
         [(f'sum by (instance, finished_reason) (rate(vllm:request_success_total{M}[$__rate_interval]))',
           "{{instance}} {{finished_reason}}")]),
        ("Tokens per second (prompt, generation)", "short",
         [(f'sum by (instance) (rate(vllm:prompt_tokens_total{M}[$__rate_interval]))', "prompt {{instance}}"),
          (f'sum by (instance) (rate(vllm:generation_tokens_total{M}[$__rate_interval]))', "generation {{instance}}")]),
    ]),
    ("Latency", [
        ("TTFT (each node's: the prefill node's is the prompt's)", "s",
         quantiles("vllm:time_to_first_token_seconds", "instance")),
        ("Inter-token latency (decode nodes)", "s", quantiles("vllm:inter_token_latency_seconds")),
        ("End-to-end: proxy (client's view) and each node", "s",     # per node: a prefill node's e2e is its prompt
         quantiles("vllm:e2e_request_latency_seconds", "instance")
         + [(f"histogram_quantile({q}, sum by (le) (rate(pdserve_proxy_request_latency_seconds_bucket"
             f"[$__rate_interval])))", f"proxy p{int(q * 100)}") for q in Q]),
    ]),
    ("P/D phases", [
        ("Proxy: time per phase (p50, p99)", "s",
         [(f"histogram_quantile({q}, sum by (le, phase) (rate(pdserve_proxy_phase_latency_seconds_bucket"
           f"[$__rate_interval])))", f"{{{{phase}}}} p{int(q * 100)}") for q in (0.5, 0.99)]),
        ("Nodes: mean time per request phase", "s",
         [(f"sum by (instance) (rate(vllm:request_{p}_time_seconds_sum{M}[$__rate_interval])) / "
           f"sum by (instance) (rate(vllm:request_{p}_time_seconds_count{M}[$__rate_interval]))", f"{p} {{{{instance}}}}")
          for p in ("queue", "prefill", "decode", "inference")]),
        ("KV load and publish time (p50, p99)", "s",
         [(f"histogram_quantile({q}, sum by (le, instance) (rate({name}_bucket{M}[$__rate_interval])))",
           f"{what} p{int(q * 100)} {{{{instance}}}}")
          for name, what in (("lmcache:time_to_retrieve", "load"), ("lmcache:time_to_store", "publish"))
          for q in (0.5, 0.99)]),
    ]),
    ("KV cache and store", [
        ("KV cache usage per node", "percentunit",
         [(f"vllm:kv_cache_usage_perc{M}", "{{instance}}")]),
        ("Running and waiting requests per node", "short",
         [(f"vllm:num_requests_running{M}", "running {{instance}}"),
          (f"vllm:num_requests_waiting{M}", "waiting {{instance}}")]),
        ("Prefix cache and store hit rate (tokens)", "percentunit",
         [(f"sum by (instance) (rate(vllm:prefix_cache_hits_total{M}[$__rate_interval])) / "
           f"sum by (instance) (rate(vllm:prefix_cache_queries_total{M}[$__rate_interval]))", "prefix cache {{instance}}"),
          (f"sum by (instance) (rate(pdserve_kv_store_hit_tokens_total{M}[$__rate_interval])) / "
           f"sum by (instance) (rate(pdserve_kv_total_tokens_total{M}[$__rate_interval]))", "store {{instance}}")]),
        ("Store hit rate by tier (objects)", "percentunit",
         [("sum by (tier) (rate(pdserve_kvstore_hits_total[$__rate_interval])) / (sum by (tier) "
           "(rate(pdserve_kvstore_hits_total[$__rate_interval])) + sum by (tier) "
           "(rate(pdserve_kvstore_misses_total[$__rate_interval])))", "{{tier}}")]),
        ("Store load GB/s by tier, KV load / publish GB/s per node", "GBs",
         [("sum by (tier) (rate(pdserve_kvstore_bytes_out_total[$__rate_interval])) / 1e9", "read {{tier}}"),
          (f"sum by (instance) (rate(pdserve_kv_loaded_bytes_total{M}[$__rate_interval])) / 1e9", "load {{instance}}"),
          (f"sum by (instance) (rate(pdserve_kv_published_bytes_total{M}[$__rate_interval])) / 1e9",
           "publish {{instance}}")]),
        ("KV accounting per node (tokens/s)", "short",
         [(f"sum by (instance) (rate(pdserve_kv_{n}_tokens_total{M}[$__rate_interval]))", f"{n} {{{{instance}}}}")
          for n in ("local_hit", "loaded", "recomputed")]),
    ]),
    ("Health", [
        ("Node health (the proxy's probes: 1 = in rotation)", "short",
         [("pdserve_proxy_node_healthy", "{{role}} {{node}}")]),
        ("Requests open per node (at the proxy)", "short",
         [("pdserve_proxy_node_in_flight", "{{role}} {{node}}")]),
        ("Preemptions, retries, aborted node calls, store failures (/s)", "short",
         [(f"sum by (instance) (rate(vllm:num_preemptions_total{M}[$__rate_interval]))", "preemptions {{instance}}"),
          ("sum by (role) (rate(pdserve_proxy_retries_total[$__rate_interval]))", "retries {{role}}"),
          ("sum by (role) (rate(pdserve_proxy_aborted_calls_total[$__rate_interval]))", "aborted calls {{role}}"),
          ("sum by (instance) (rate(pdserve_kv_transfer_load_failures_total[$__rate_interval]) + "
           "rate(pdserve_kv_transfer_publish_failures_total[$__rate_interval]))", "KV failures {{instance}}")]),
        ("Scrape targets up", "short", [("up", "{{instance}}")]),
    ]),
]


def dashboard() -> dict:
    panels, y, pid = [], 0, 1
    for row, items in PANELS:
        panels.append({"type": "row", "title": row, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        for i, (title, unit, targets) in enumerate(items):
            panels.append({"type": "timeseries", "title": title, "id": pid, "datasource": DS,
                           "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": y + (i // 3) * 8},
                           "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                           "targets": [{"datasource": DS, "expr": expr, "legendFormat": legend,
                                        "refId": chr(ord("A") + k)} for k, (expr, legend) in enumerate(targets)]})
            pid += 1
        y += 8 * ((len(items) + 2) // 3)
    variables = [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                 {"name": "model_name", "type": "query", "datasource": DS, "label": "model",
                  "query": "label_values(vllm:num_requests_running, model_name)", "refresh": 2,
                  "includeAll": True, "multi": True, "current": {"text": "All", "value": "$__all"}}]
    return {"title": "pdserve: disaggregated prefill / decode", "uid": "pdserve-disagg", "schemaVersion": 39,
            "tags": ["pdserve", "vllm", "llm"], "timezone": "browser", "refresh": "10s",
            "time": {"from": "now-30m", "to": "now"}, "templating": {"list": variables}, "panels": panels}


if __name__ == "__main__":
    out = Path(__file__).with_name("pdserve-disagg.json")
    out.write_text(json.dumps(dashboard(), indent=1) + "\n")
    print(f"wrote {out}")
