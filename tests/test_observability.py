"""Operating pdserve like vLLM: vLLM's metrics on every node, the proxy's own, the Grafana dashboard's queries, and
OpenTelemetry traces across proxy -> prefill node -> decode node -- against one running disaggregated cluster
(store daemon, one prefill node, one decode node, the proxy; tracing on, to a real OTLP/HTTP endpoint started here).

The vLLM list (``tests/data/vllm_metrics.json``) is taken from vLLM's source and docs; the trace is received and
decoded as protobuf by ``otlp_collector`` (the SDK's own exporter sends it). With tracing off, no OpenTelemetry
module is imported on the request path of a node or the proxy (a fresh process checks ``sys.modules``).
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from otlp_collector import OTLPCollector
from pdserve.engine.server.metrics import build_1_2_5_buckets
from pdserve.proxy.cluster import ClusterSpec, LocalCluster
from pdserve.proxy.serve import metrics_urls

DATA = Path(__file__).parent / "data" / "vllm_metrics.json"
DASHBOARD = Path(__file__).parent.parent / "docs" / "grafana" / "pdserve-disagg.json"
MAX_MODEL_LEN = 512
NODE_FLAGS = ("--kv-chunk-tokens", "32", "--block-size", "16", "--max-model-len", str(MAX_MODEL_LEN))
LONG = ("The quick brown fox jumps over the lazy dog while the cat watches from the warm window. " * 4).strip()
PROXY_METRICS = {     # pdserve's own (the README's metrics table): family -> (type, label names)
    "pdserve_proxy_requests": ("counter", {"endpoint", "outcome"}),
    "pdserve_proxy_retries": ("counter", {"role"}),
    "pdserve_proxy_aborted_calls": ("counter", {"role"}),
    "pdserve_proxy_node_in_flight": ("gauge", {"role", "node"}),
    "pdserve_proxy_node_healthy": ("gauge", {"role", "node"}),
    "pdserve_proxy_request_latency_seconds": ("histogram", {"endpoint"}),
    "pdserve_proxy_phase_latency_seconds": ("histogram", {"phase"}),
}


@pytest.fixture(scope="module")
def collector():
    with OTLPCollector() as c:
        yield c


@pytest.fixture(scope="module")
def cluster(tiny_llama, collector):
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"      # the children's batch processor exports every 100 ms
    trace = ("--otlp-traces-endpoint", collector.url)
    try:
        with LocalCluster(str(tiny_llama), ClusterSpec(prefill=1, decode=1, node_flags=NODE_FLAGS + trace,
                                                       proxy_flags=trace)) as c:
            _traffic(c)
            yield c
    finally:
        os.environ.pop("OTEL_BSP_SCHEDULE_DELAY") if saved is None else os.environ.update(
            OTEL_BSP_SCHEDULE_DELAY=saved)


def _complete(url: str, prompt: str, max_tokens: int = 6, stream: bool = False, headers=None) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": stream}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120, headers=headers)
    assert r.status_code == 200, r.text
    return r


def _traffic(cluster) -> None:
    """A few requests: a shared prefix (store hits and loads), a stream, a short prompt."""
    _complete(cluster.url, LONG + " One more sentence about birds.")
    _complete(cluster.url, LONG + " A different ending about fish.", stream=True)
    _complete(cluster.url, "Hello there", max_tokens=3)


def _families(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _labels(family) -> set[str]:
    return {k for s in family.samples for k in s.labels} - {"le"}


def _buckets(family) -> list[float]:
    bounds = {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
    return sorted(b for b in bounds if not math.isinf(b))


def _count(family, suffix: str = "_count") -> float:
    return sum(s.value for s in family.samples if s.name.endswith(suffix))


def test_nodes_export_vllms_metrics_with_its_types_labels_and_buckets(cluster):
    """Catches: a renamed or retyped metric, a missing or extra label, other bucket bounds, a vLLM metric
    exported a second time under a pdserve name, a deprecated one exported."""
    spec = json.loads(DATA.read_text())
    for url in (*cluster.prefill_urls, *cluster.decode_urls):
        fams = _families(url)
        for m in spec["metrics"]:
            name, where = m["name"], f"{m['name']} on {url}"
            if m["status"] == "exported":
                assert name in fams, f"{where}: not exported"
                family = fams[name]
                assert family.type == m["type"], f"{where}: {family.type}, vLLM: {m['type']}"
                assert _labels(family) == set(m["labels"]), f"{where}: labels {_labels(family)}"
                if m["type"] == "histogram":
                    expected = m["buckets"] if isinstance(m["buckets"], list) else build_1_2_5_buckets(MAX_MODEL_LEN)
                    assert _buckets(family) == [float(b) for b in expected], where
                assert "pdserve_" + name.split(":", 1)[1] not in fams, f"{where}: exported twice"
            elif m["status"] == "mapped":
                assert re.search(r"pdserve_\w+", m["note"]).group(0).removesuffix("_total") in fams, where
            else:
                assert name not in fams, f"{where}: {m['status']}: {m['note']}"
        reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
        assert reasons == set(spec["finished_reasons"])


def test_engine_core_times_reach_the_histograms(cluster):
    """The engine core's RequestTimes cross to the API process: every node observed queue / prefill / decode /
    inference times, the prefill node its publishes (lmcache:time_to_store), the decode node its loads."""
    prefill, decode = _families(cluster.prefill_urls[0]), _families(cluster.decode_urls[0])
    finished = _count(decode["vllm:request_success"], "_total")
    for phase in ("queue", "prefill", "decode", "inference"):
        assert _count(decode[f"vllm:request_{phase}_time_seconds"]) == finished > 0, phase
        assert _count(prefill[f"vllm:request_{phase}_time_seconds"]) > 0, phase
    assert _count(prefill["lmcache:time_to_store"]) > 0 and _count(prefill["lmcache:num_store_requests"], "_total") > 0
    assert _count(decode["lmcache:time_to_retrieve"]) > 0 and _count(decode["pdserve_kv_loaded_bytes"], "_total") > 0
    assert _count(decode["vllm:iteration_tokens_total"]) > 0
    assert _count(decode["vllm:request_params_n"]) == finished


def test_proxy_exports_its_phase_metrics(cluster):
    fams = _families(cluster.url)
    for name, (kind, labels) in PROXY_METRICS.items():
        assert name in fams and fams[name].type == kind, name
        if fams[name].samples:
            assert _labels(fams[name]) == labels, name
    phases = {s.labels["phase"] for s in fams["pdserve_proxy_phase_latency_seconds"].samples}
    assert phases == {"prefill", "decode_first_byte", "decode"}


def _promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: label matchers, grouping clauses, ranges, strings, numbers and
    function names taken out."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", expr):       # not the e9 of 1e9
        following = expr[m.end():].lstrip()[:1]
        if following != "(":
            names.add(m.group(0))
    return names


def test_promql_parser_finds_metric_names():
    expr = ('histogram_quantile(0.99, sum by (le, phase) (rate(pdserve_proxy_phase_latency_seconds_bucket'
            '{model_name=~"$m"}[$__rate_interval]))) / sum(vllm:num_requests_running) / 1e9')
    assert _promql_metrics(expr) == {"pdserve_proxy_phase_latency_seconds_bucket", "vllm:num_requests_running"}


def test_every_metric_the_dashboard_queries_is_exported(cluster):
    """Catches: a panel querying a name no process exports (a typo, a rename, a metric that never appears)."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    wanted = set().union(*map(_promql_metrics, exprs)) - {"up"}          # up: Prometheus's own, per target
    exported = set()
    for url in metrics_urls(cluster):
        text = httpx.get(url + "/metrics", timeout=10).text
        exported |= {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert sorted(wanted - exported) == []
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for what in ("Request rate", "TTFT", "Inter-token", "End-to-end", "KV cache usage", "hit rate", "GB/s",
                 "phase", "health"):
        assert what in titles, what


def _by_parent(spans):
    out = {}
    for s in spans:
        out.setdefault(s.parent_span_id, []).append(s)
    return out


def test_one_request_gives_one_trace_across_proxy_prefill_and_decode(cluster, collector):
    """The client's traceparent -> proxy span -> its prefill and decode calls -> each node's llm_request span ->
    the node's phase spans; one trace id, each span nested in its parent (ids and times)."""
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    owls = " ".join(["Owls glide over the silent meadow while the moon rises slowly."] * 6)   # no shared prefix:
    _complete(cluster.url, owls, max_tokens=4, headers={"traceparent": f"00-{trace_id}-{client_span}-01"})  # a load

    def complete(spans) -> bool:
        names = {(s.service, s.name) for s in spans if s.trace_id == trace_id}
        return {("pdserve-prefill", "kv_publish"), ("pdserve-decode", "decode"),
                ("pdserve-proxy", "POST /v1/completions")} <= names

    spans = [s for s in collector.wait_for(complete) if s.trace_id == trace_id]
    children = _by_parent(spans)
    [root] = children[client_span]
    assert (root.service, root.name) == ("pdserve-proxy", "POST /v1/completions")
    calls = {s.name: s for s in children[root.span_id]}
    assert set(calls) == {"prefill", "decode"} and all(s.service == "pdserve-proxy" for s in calls.values())
    nodes = {}
    for phase, call in calls.items():
        [node] = children[call.span_id]
        assert (node.service, node.name) == (f"pdserve-{phase}", "llm_request")
        assert node.attributes["gen_ai.usage.prompt_tokens"] > 0 and node.attributes["pdserve.role"] == phase
        nodes[phase] = node
    assert {s.name for s in children[nodes["prefill"].span_id]} >= {"queue", "prefill", "kv_publish"}
    assert {s.name for s in children[nodes["decode"].span_id]} >= {"queue", "kv_load", "decode"}
    assert nodes["decode"].attributes["gen_ai.usage.completion_tokens"] == 4
    load = next(s for s in children[nodes["decode"].span_id] if s.name == "kv_load")
    assert load.attributes["pdserve.kv.bytes"] > 0
    slack = 5_000_000                                  # 5 ms: node spans are placed from monotonic clocks
    for parent in spans:
        for child in children.get(parent.span_id, []):
            assert child.start_ns >= parent.start_ns - slack and child.end_ns <= parent.end_ns + slack, \
                f"{child.service}/{child.name} outside {parent.service}/{parent.name}"


_NO_TRACING = textwrap.dedent('''
    import asyncio, json, sys
    import httpx
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.core.async_engine import AsyncEngine
    from pdserve.engine.server import build_app
    from pdserve.engine.text.tokenizer import load_tokenizer
    from pdserve.proxy.app import build_app as build_proxy
    from pdserve.proxy.config import ProxyConfig

    def otel():
        return {m for m in sys.modules if m.startswith("opentelemetry")}

    imported = otel()      # FastAPI imports the OpenTelemetry API itself where it is installed (fastapi.telemetry)
    model, prefill, decode = sys.argv[1:4]
    parent = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
    body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}

    async def main():
        engine = AsyncEngine(EngineConfig(model=model))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine)), base_url="http://n") as c:
                for stream in (False, True):
                    r = await c.post("/v1/completions", json={**body, "stream": stream}, headers=parent)
                    assert r.status_code == 200, r.text
        finally:
            engine.shutdown()
        proxy = build_proxy(ProxyConfig(prefill_urls=(prefill,), decode_urls=(decode,), model=model),
                            load_tokenizer(model))
        async with proxy.router.lifespan_context(proxy):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://p") as c:
                for stream in (False, True):
                    r = await c.post("/v1/completions", json={**body, "stream": stream}, headers=parent)
                    assert r.status_code == 200, r.text

    asyncio.run(main())
    print(json.dumps({"new": sorted(otel() - imported), "all": sorted(otel())}))
''')


def test_tracing_off_imports_no_opentelemetry(cluster, tiny_llama, tmp_path):
    """A node (in-process engine) and the proxy serve requests that carry a traceparent, streamed and not, with
    tracing off: no opentelemetry module is imported on the request path, and neither the SDK nor an exporter at
    all (FastAPI imports the OpenTelemetry API and propagators by itself where they are installed: not ours). Catches a top-level import in pdserve's modules, or an unguarded call on the request path."""
    out = subprocess.run([sys.executable, "-c", _NO_TRACING, str(tiny_llama), cluster.prefill_urls[0],
                          cluster.decode_urls[0]], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert modules["new"] == []                                   # nothing imported on the request path
    assert not [m for m in modules["all"] if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))]


def test_a_pd_request_is_counted_on_both_nodes_as_the_readme_says(cluster):
    """The README's P/D counting (review 42): one disaggregated request adds 1 finished request on each node, the
    prompt on each, 1 generated token on the prefill node (``length``) and every token on the decode node."""
    urls = {"prefill": cluster.prefill_urls[0], "decode": cluster.decode_urls[0], "proxy": cluster.url}

    def totals() -> dict:
        out = {}
        for role, url in urls.items():
            for family in _families(url).values():
                for s in family.samples:
                    if s.name.endswith("_total"):
                        key = (role, s.name, s.labels.get("finished_reason") or s.labels.get("outcome")
                               or s.labels.get("decision"))
                        out[key] = out.get(key, 0.0) + s.value
        return out

    before = totals()
    prompt = " ".join(["Herons stand still in the shallow river at dawn."] * 5)
    usage = _complete(cluster.url, prompt, max_tokens=5).json()["usage"]
    after = totals()
    d = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    n = usage["prompt_tokens"]
    assert d[("proxy", "pdserve_proxy_pd_decisions_total", "prefill")] == 1
    assert d[("prefill", "vllm:request_success_total", "length")] == 1
    assert d[("prefill", "vllm:prompt_tokens_total", None)] == n
    assert d[("prefill", "vllm:generation_tokens_total", None)] == 1
    assert d[("decode", "vllm:request_success_total", "length")] == 1
    assert d[("decode", "vllm:prompt_tokens_total", None)] == n
    assert d[("decode", "vllm:generation_tokens_total", None)] == usage["completion_tokens"] == 5


def test_external_prefix_cache_counts_the_decode_nodes_loads(cluster):
    """vllm:external_prefix_cache_hits is the accounting's need_to_load (review 42): the decode node, which loaded
    the prompts' KV, counts them; queries are the tokens it looked up; both equal pdserve's accounting family."""
    fams = _families(cluster.decode_urls[0])
    hits = _count(fams["vllm:external_prefix_cache_hits"], "_total")
    queries = _count(fams["vllm:external_prefix_cache_queries"], "_total")
    assert hits == _count(fams["pdserve_kv_need_to_load_tokens"], "_total") > 0
    assert queries == _count(fams["pdserve_kv_total_tokens"], "_total") >= hits
