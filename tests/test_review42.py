"""Review of issue 42 (vLLM's metrics, per-request times, tracing): each test reproduces a finding, or checks a
figure against what a client measures.

- tracing's shutdown with the collector down waited ~27 s (the SDK's batch processor retries; its own limit is 30 s):
  a node or proxy stop stalled for it;
- ``vllm:num_requests_waiting`` left out requests loading remote KV and compiling grammars (vLLM's waiting queue
  holds both): a decode node busy loading showed 0 running, 0 waiting;
- a request the engine refused at submit (HTTP 400) counted as ``vllm:request_success{finished_reason="error"}``
  with an e2e latency and a 0-token prompt: vLLM counts no request it never took;
- a request aborted before its first output observed ``vllm:request_prompt_tokens`` = 0 (vLLM: the prompt's length).

Plus the value checks: with ``max_num_seqs`` 1 a request that queues behind another observes that wait as its queue
time, and the counters add up to the responses' usage.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine import tracing
from pdserve.engine.config import EngineConfig, SchedulerConfig
from pdserve.engine.sched.request import RequestStatus
from pdserve.engine.server.generation import EngineCall, Generation
from test_scheduler import Harness, ScriptedLoads


def test_tracing_shutdown_with_the_collector_down_is_bounded():
    """Before: ``provider.shutdown()`` took ~27 s against a closed port (the exporter's retries and backoff inside
    the batch processor's 30 s join), so ``pdserve node`` / ``proxy`` stops waited that long."""
    pytest.importorskip("opentelemetry.sdk")
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()                                          # nothing listens there: connection refused
    assert tracing.setup("review42", f"http://127.0.0.1:{port}")
    try:
        for i in range(5):
            tracing.end(tracing.start_span(f"s{i}"))
    finally:
        start = time.monotonic()
        tracing.shutdown()
        took = time.monotonic() - start
    assert not tracing.enabled()
    assert took < tracing.SHUTDOWN_TIMEOUT_S + 1.5, f"tracing.shutdown took {took:.1f} s"


def test_waiting_gauge_counts_requests_loading_remote_kv():
    """vLLM keeps WAITING_FOR_REMOTE_KVS requests in its waiting queue (``num_requests_waiting``); before, a request
    loading its KV counted as neither running nor waiting."""
    h = Harness(num_blocks=16, block_size=4)
    loads = ScriptedLoads(loadable=12)
    h.sched.connector = loads
    a = h.add("a", range(1, 17), max_tokens=4, ignore_eos=True)
    h.step()
    assert a.status == RequestStatus.WAITING_FOR_KV
    assert (h.sched.num_running, h.sched.num_waiting) == (0, 1)
    h.sched.abort_request("a")                              # aborted while loading: no longer a request
    assert h.sched.num_waiting == 0
    loads.done = {"a": 12}
    h.step()
    assert h.sched.num_waiting == 0 and not h.sched.has_unfinished()


# ---- a node (in-process engine, max_num_seqs 1) ------------------------------------------------------------


@pytest.fixture(scope="module")
def node(tiny_llama):
    from pdserve.engine.core.async_engine import AsyncEngine
    from pdserve.engine.server import build_app
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), scheduler=SchedulerConfig(max_num_seqs=1)))
    try:
        yield engine, build_app(engine)
    finally:
        engine.shutdown()


def _samples(text: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "le" not in s.labels:
                out[(s.name, s.labels.get("finished_reason"))] = s.value
    return out


async def _scrape(client) -> dict[tuple, float]:
    return _samples((await client.get("/metrics")).text)


def _delta(after: dict, before: dict, name: str, reason: str | None = None) -> float:
    return after.get((name, reason), 0.0) - before.get((name, reason), 0.0)


def _run(app, body):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://n", timeout=120) as c:
            return await body(c)
    return asyncio.run(go())


def test_a_request_the_engine_refuses_is_not_counted(node):
    """Before: kv_transfer_params asking to load remote KV from a node without a store -> 400, yet
    vllm:request_success{finished_reason="error"} +1, an e2e latency and a 0-token prompt observed."""
    _, app = node

    async def body(c):
        before = await _scrape(c)
        r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "kv_transfer_params": {
            "do_remote_prefill": True, "chunk_keys": ["zz"]}})
        return r, before, await _scrape(c)

    r, before, after = _run(app, body)
    assert r.status_code == 400, r.text
    changed = {k: after[k] - before.get(k, 0.0) for k in after
               if k[0].startswith("vllm:request") and after[k] != before.get(k, 0.0)}
    assert changed == {}


def test_an_abort_before_any_output_observes_the_prompts_length(node):
    """Before: a request aborted before its first output (a client gone while it queued) observed
    vllm:request_prompt_tokens 0; vLLM observes len(prompt) for every finished request."""
    engine, app = node
    metrics = app.state.node.metrics
    ids = list(range(5, 5 + 23))

    async def go():
        gen = Generation(engine, metrics, [EngineCall("review42-abort-0", 0, ids, _params(4))], time.monotonic())
        gen.start()
        await gen.close()                                  # the client left before any output was read

    get = metrics.registry.get_sample_value
    labels = {"model_name": engine.model_name, "engine": "0"}
    before = {s: get(f"vllm:request_prompt_tokens_{s}", labels) or 0.0 for s in ("count", "sum")}
    aborted = get("vllm:request_success_total", {**labels, "finished_reason": "abort"}) or 0.0
    asyncio.run(go())
    assert get("vllm:request_success_total", {**labels, "finished_reason": "abort"}) == aborted + 1
    after = {s: get(f"vllm:request_prompt_tokens_{s}", labels) for s in ("count", "sum")}
    assert (after["count"] - before["count"], after["sum"] - before["sum"]) == (1, len(ids))


def _params(max_tokens: int):
    from pdserve.engine.sampling_params import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_queue_time_and_counts_match_what_the_client_sees(node):
    """max_num_seqs 1: B is sent while A runs, so B's queue time is A's remaining run (>= half of A's time at the
    client); each request's e2e >= its queue + inference; the counters equal the usage the client got."""
    _, app = node

    async def body(c):
        before = await _scrape(c)

        async def one(max_tokens: int, delay: float):
            await asyncio.sleep(delay)
            t0 = time.monotonic()
            r = await c.post("/v1/completions", json={"prompt": "Hello there friend", "max_tokens": max_tokens,
                                                       "ignore_eos": True, "temperature": 0.0})
            assert r.status_code == 200, r.text
            return time.monotonic() - t0, r.json()["usage"]

        (a_s, a_use), (b_s, b_use) = await asyncio.gather(one(120, 0.0), one(4, 0.02))
        return a_s, b_s, [a_use, b_use], before, await _scrape(c)

    a_s, b_s, usages, before, after = _run(app, body)
    d = lambda name, reason=None: _delta(after, before, name, reason)     # noqa: E731
    assert d("vllm:request_success_total", "length") == 2
    assert d("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert d("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert d("vllm:inter_token_latency_seconds_count") == sum(u["completion_tokens"] - 1 for u in usages)
    queue = d("vllm:request_queue_time_seconds_sum")
    assert queue >= 0.5 * (a_s - 0.02), (queue, a_s, b_s)            # B waited for most of A
    assert queue <= b_s + 0.05, (queue, b_s)
    assert d("vllm:request_queue_time_seconds_sum") + d("vllm:request_inference_time_seconds_sum") \
        <= d("vllm:e2e_request_latency_seconds_sum") + 0.01
    assert d("vllm:e2e_request_latency_seconds_sum") <= a_s + b_s + 0.01


# ---- the dashboard ---------------------------------------------------------------------------------------------

def _dashboard_exprs() -> list[str]:
    import json
    from pathlib import Path
    path = Path(__file__).parent.parent / "docs" / "grafana" / "pdserve-disagg.json"
    return [t["expr"] for p in json.loads(path.read_text())["panels"] for t in p.get("targets", [])]


def test_node_latency_quantiles_are_per_node():
    """Before: the e2e panel's node percentiles summed the prefill nodes' e2e (the prompt only: max_tokens 1) with
    the decode nodes' (the whole answer) into one distribution -- its p50 was neither. Every quantile over a
    histogram both roles observe with a different meaning (TTFT, e2e) keeps ``instance``."""
    import re
    for metric in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds"):
        exprs = [e for e in _dashboard_exprs() if f"{metric}_bucket" in e]
        assert exprs, metric
        for expr in exprs:
            grouping = re.search(r"by \(([^)]*)\)", expr).group(1)
            assert "instance" in {g.strip() for g in grouping.split(",")}, expr


def test_dashboard_json_is_what_make_dashboard_writes():
    """The JSON is generated (docs/grafana/make_dashboard.py): an edit to one without the other is caught."""
    import importlib.util
    import json
    from pathlib import Path
    root = Path(__file__).parent.parent / "docs" / "grafana"
    spec = importlib.util.spec_from_file_location("make_dashboard", root / "make_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert json.loads((root / "pdserve-disagg.json").read_text()) == module.dashboard()


# ---- a client's traceparent at the proxy ---------------------------------------------------------------------


def test_no_trust_traceparent_keeps_a_client_from_forcing_sampling(tiny_llama, monkeypatch):
    """The README samples at the proxy (``OTEL_TRACES_SAMPLER=parentbased_traceidratio``): a client's traceparent
    with the sampled flag overrode that ratio (ratio 0 here: its request was traced anyway, under the trace id the
    client chose). ``--no-trust-traceparent`` starts every request's trace at the proxy: the ratio holds."""
    pytest.importorskip("opentelemetry.sdk")
    from otlp_collector import OTLPCollector
    from pdserve.engine.text.tokenizer import load_tokenizer
    from pdserve.proxy.app import build_app as build_proxy
    from pdserve.proxy.config import ProxyConfig

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    trusted, untrusted = "ab" * 16, "cd" * 16
    dead = "http://127.0.0.1:9"                                # no node: the request fails, its span is recorded
    tokenizer = load_tokenizer(str(tiny_llama))

    async def send(trust: bool, trace_id: str) -> None:
        config = ProxyConfig(prefill_urls=(dead,), decode_urls=(dead,), model=str(tiny_llama), served_model_name="m",
                             trust_traceparent=trust, connect_timeout_s=0.2)
        app = build_proxy(config, tokenizer)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p", timeout=30) as c:
            await c.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2},
                         headers={"traceparent": f"00-{trace_id}-{'ef' * 8}-01"})

    with OTLPCollector() as collector:
        assert tracing.setup("pdserve-proxy", collector.url)
        try:
            asyncio.run(send(True, trusted))
            asyncio.run(send(False, untrusted))
        finally:
            tracing.shutdown()                                  # flushes what was sampled
        traces = {s.trace_id for s in collector.snapshot()}
    assert trusted in traces                                    # the default, as vLLM: the client's context is used
    assert not traces - {trusted}                               # untrusted: the proxy's ratio 0 sampled nothing


def test_itl_is_the_engines_step_time_not_the_api_loops_delay(node):
    """vLLM's inter-token latency is the gap between the engine core's timestamps of a request's outputs. Before,
    it was timed where the API process received each delta: an event loop busy for 0.3 s (other requests' work)
    showed as one 0.3 s ITL while the engine core kept producing a token every few ms."""
    engine, app = node
    metrics = app.state.node.metrics
    labels = {"model_name": engine.model_name, "engine": "0"}
    slow = lambda: metrics.registry.get_sample_value(                    # noqa: E731
        "vllm:inter_token_latency_seconds_count", labels) - metrics.registry.get_sample_value(
        "vllm:inter_token_latency_seconds_bucket", {**labels, "le": "0.2"})
    before = slow()

    async def go():
        gen = Generation(engine, metrics, [EngineCall("review42-itl-0", 0, list(range(5, 15)), _params(40))],
                         time.monotonic())
        first = True
        async for _ in gen.outputs():
            if first:
                time.sleep(0.3)                              # the event loop is busy; the engine core is not
                first = False

    asyncio.run(go())
    assert slow() - before == 0


def test_step_time_crosses_the_wire():
    from pdserve.engine.core import messages as m
    from pdserve.engine.outputs import RequestOutput
    out = RequestOutput("r", [5], "", False, None, 3, 0, step_time=1234.5)
    wire = m.decode_core_message(m.encode(m.CoreOutputs([m.output_to_wire(out, seq=1)])))
    assert m.output_from_wire(wire.outputs[0]).step_time == 1234.5


def test_a_decode_nodes_tpot_divides_by_the_intervals_it_timed():
    """A decode node's first output is the prefill node's token (no times: not sampled here); its decode time runs
    from the first token sampled here to the last, G - 2 intervals for G tokens. Before, TPOT divided it by G - 1:
    25 % low at G = 5, 0 observed at G = 2."""
    from pdserve.engine.outputs import RequestOutput, RequestTimes
    from pdserve.engine.server.request_metrics import RequestTracker
    from test_request_metrics import _metrics
    metrics = _metrics()
    first = RequestTimes(queued=10.0, scheduled=10.5, first_token=10.6)
    last = RequestTimes(queued=10.0, scheduled=10.5, first_token=10.6, last_token=10.9)
    tracker = RequestTracker(metrics, arrival=9.0, max_tokens=5, num_prompt_tokens=8)
    deltas = [(None, False), (first, False), (None, False), (None, False), (last, True)]   # token 1: transferred
    for times, finished in deltas:
        tracker.on_output(RequestOutput("r", [7], "", finished, "length" if finished else None, 8, 0, times=times))
    tracker.on_end("length")
    labels = {"model_name": "m", "engine": "0"}
    tpot = metrics.registry.get_sample_value("vllm:request_time_per_output_token_seconds_sum", labels)
    assert tpot == pytest.approx(0.3 / 3)


def test_hostile_traceparents_neither_fail_nor_flood_the_log(caplog):
    """Malformed, oversized, upper-case, zero ids, many tracestate members: each gives a context (a new trace where
    it is not valid) and no log line. Before, each traceparent over 512 characters logged a warning: one line per
    request a client sends."""
    pytest.importorskip("opentelemetry.sdk")
    import logging
    valid = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    hostile = ["garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01", valid.upper(), valid + " " * 600,
               valid + "-" * 8000, "ff-" + valid[3:], "\u00e9" * 40, valid + "," + valid]
    assert tracing.setup("review42", "http://127.0.0.1:9")
    try:
        with caplog.at_level(logging.DEBUG - 5):
            contexts = [tracing.extract({"traceparent": h, "tracestate": ",".join(f"k{i}=v" for i in range(300))})
                        for h in hostile for _ in range(20)]
        assert all(c is not None for c in contexts)
        noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert noisy == [], noisy[:3]
        span = tracing.start_span("s", "server", tracing.extract({"traceparent": valid}))
        assert format(span.get_span_context().trace_id, "032x") == "a" * 32    # a valid one is still followed
        tracing.end(span)
    finally:
        tracing.shutdown(0.1)


def test_external_prefix_cache_is_exported_under_vllms_names():
    """vLLM's KV-connector prefix cache counters apply to the store: the README said they were the same figures as
    pdserve_kv_total_tokens / pdserve_kv_store_hit_tokens and left them out -- but vLLM's hits are the tokens the
    connector provides beyond the local prefix cache (need_to_load), and pdserve_kv_need_to_load_tokens_total, in
    the README's table, was never exported (the totals had no need_to_load)."""
    from test_request_metrics import _metrics, _stats, _value
    totals = {"total_tokens": 146, "local_hit_tokens": 32, "store_hit_tokens": 128, "need_to_load_tokens": 96,
              "loaded_tokens": 96, "recomputed_tokens": 18}
    metrics = _metrics(_stats(kv_totals=totals))
    e = {"engine": "0"}
    assert _value(metrics, "vllm:external_prefix_cache_queries_total", **e) == 146
    assert _value(metrics, "vllm:external_prefix_cache_hits_total", **e) == 96       # not store_hit's 128
    assert metrics.registry.get_sample_value("pdserve_kv_need_to_load_tokens_total", {"model_name": "m"}) == 96



def test_a_failed_prefill_call_is_timed_like_a_failed_decode_call(tiny_llama):
    """pdserve_proxy_phase_latency_seconds{phase="prefill"} was observed only when the prefill calls succeeded (the
    decode phase in a ``finally``): a prefill node answering errors left its phase's time out of the histogram."""
    from fake_node import FakeNode, Reply
    from pdserve.engine.text.tokenizer import load_tokenizer
    from pdserve.proxy.app import build_app as build_proxy
    from pdserve.proxy.config import ProxyConfig
    prefill, decode = FakeNode(), FakeNode()
    try:
        prefill.script("/v1/completions", Reply(status=400))          # a client error: not retried elsewhere
        app = build_proxy(ProxyConfig(prefill_urls=(prefill.url,), decode_urls=(decode.url,), model=str(tiny_llama)),
                          load_tokenizer(str(tiny_llama)))

        async def go():
            async with app.router.lifespan_context(app):
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c:
                    r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
                    return r.status_code, (await c.get("/metrics")).text

        status, text = asyncio.run(go())
    finally:
        prefill.stop()
        decode.stop()
    assert status == 400 and len(prefill.calls) == 1 and not decode.calls
    counts = {s.labels["phase"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "pdserve_proxy_phase_latency_seconds_count"}
    assert counts == {"prefill": 1}, counts
