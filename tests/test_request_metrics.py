"""The pieces behind vLLM's per-request and per-step metrics, without a node: the engine core's ``RequestTimes`` on
the wire, ``RequestTracker``'s intervals (vLLM's definitions), tokens-per-step buckets, ``tracing``'s URL rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.engine import tracing
from pdserve.engine.core import messages as m
from pdserve.engine.core.llm_engine import IterationTokens
from pdserve.engine.outputs import ITERATION_TOKEN_BUCKETS, EngineStats, RequestOutput, RequestTimes
from pdserve.engine.server.metrics import ServerMetrics, build_1_2_5_buckets
from pdserve.engine.server.request_metrics import RequestTracker

TIMES = RequestTimes(queued=100.0, scheduled=100.25, first_token=100.75, last_token=102.0, num_preemptions=1,
                     kv_load_start=100.05, kv_load_end=100.2, kv_loaded_bytes=4096, kv_publish_start=100.8,
                     kv_publish_end=101.3, kv_published_bytes=8192)


def _stats(**kw) -> EngineStats:
    base = dict(num_running=0, num_waiting=0, kv_usage=0.0, prefix_cache_queries=0, prefix_cache_hits=0,
                kv_totals={}, kv_store={}, kv_transfer={}, num_free_blocks=4, num_blocks=4)
    return EngineStats(**{**base, **kw})


def _metrics(stats: EngineStats | None = None) -> ServerMetrics:
    engine = SimpleNamespace(stats=lambda: stats or _stats(), max_model_len=512)
    return ServerMetrics(engine, "m")


def _value(metrics: ServerMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    return 0.0 if value is None else value


def test_request_times_cross_the_wire():
    out = RequestOutput("r", [5], "", True, "length", 3, 0, times=TIMES)
    wire = m.decode_core_message(m.encode(m.CoreOutputs([m.output_to_wire(out, seq=1)])))
    assert m.output_from_wire(wire.outputs[0]).times == TIMES


def _delta(tokens: int, finished: bool, times=None) -> RequestOutput:
    return RequestOutput("r", [7] * tokens, "", finished, "length" if finished else None, 10, 0, times=times)


def test_tracker_observes_vllms_intervals_from_the_core_times():
    metrics = _metrics()
    tracker = RequestTracker(metrics, arrival=99.9, max_tokens=16)
    tracker.on_output(_delta(1, False, TIMES))
    for _ in range(3):
        tracker.on_output(_delta(1, False))
    tracker.on_output(_delta(1, True, TIMES))
    tracker.on_end("length")
    e = {"engine": "0"}
    assert _value(metrics, "vllm:request_queue_time_seconds_sum", **e) == pytest.approx(0.25)
    assert _value(metrics, "vllm:request_prefill_time_seconds_sum", **e) == pytest.approx(0.5)
    assert _value(metrics, "vllm:request_decode_time_seconds_sum", **e) == pytest.approx(1.25)
    assert _value(metrics, "vllm:request_inference_time_seconds_sum", **e) == pytest.approx(1.75)
    assert _value(metrics, "vllm:request_time_per_output_token_seconds_sum", **e) == pytest.approx(1.25 / 4)
    assert _value(metrics, "vllm:time_to_first_token_seconds_count", **e) == 1
    assert _value(metrics, "vllm:inter_token_latency_seconds_count", **e) == 4
    assert _value(metrics, "vllm:generation_tokens_total", **e) == 5
    assert _value(metrics, "vllm:prompt_tokens_total", **e) == 10
    assert _value(metrics, "vllm:request_success_total", finished_reason="length", **e) == 1
    assert _value(metrics, "vllm:request_params_max_tokens_sum", **e) == 16
    lm = {"worker_id": "0"}
    assert _value(metrics, "lmcache:time_to_retrieve_sum", **lm) == pytest.approx(0.15)
    assert _value(metrics, "lmcache:time_to_store_sum", **lm) == pytest.approx(0.5)
    assert _value(metrics, "pdserve_kv_loaded_bytes_total") == 4096
    assert _value(metrics, "pdserve_kv_published_bytes_total") == 8192


def test_a_request_that_never_ran_observes_no_phase():
    metrics = _metrics()
    tracker = RequestTracker(metrics, arrival=1.0, max_tokens=4)
    tracker.on_output(_delta(0, True, RequestTimes(queued=1.0)))
    tracker.on_end("abort")
    tracker.on_end("abort")                                           # once only
    e = {"engine": "0"}
    assert _value(metrics, "vllm:request_success_total", finished_reason="abort", **e) == 1
    assert _value(metrics, "vllm:e2e_request_latency_seconds_count", **e) == 1
    for phase in ("queue", "prefill", "decode", "inference"):
        assert _value(metrics, f"vllm:request_{phase}_time_seconds_count", **e) == 0


def test_tokens_per_step_land_in_vllms_buckets_and_export_cumulatively():
    steps = IterationTokens()
    for n in (0, 1, 8, 9, 16384, 20000):          # 0: a step that scheduled nothing is not a step
        steps.observe(n)
    assert steps.counts[0] == 1 and steps.counts[1] == 1 and steps.counts[2] == 1
    assert steps.counts[len(ITERATION_TOKEN_BUCKETS) - 1] == 1 and steps.counts[-1] == 1
    metrics = _metrics(_stats(iteration_tokens=steps.counts, iteration_tokens_sum=steps.total))
    e = {"engine": "0"}
    assert _value(metrics, "vllm:iteration_tokens_total_bucket", le="8.0", **e) == 2
    assert _value(metrics, "vllm:iteration_tokens_total_bucket", le="16384.0", **e) == 4
    assert _value(metrics, "vllm:iteration_tokens_total_bucket", le="+Inf", **e) == 5
    assert _value(metrics, "vllm:iteration_tokens_total_count", **e) == 5
    assert _value(metrics, "vllm:iteration_tokens_total_sum", **e) == 1 + 8 + 9 + 16384 + 20000


def test_1_2_5_buckets_are_vllms():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(512)[-1] == 500


def test_traces_url():
    assert tracing.traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert tracing.traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
        tracing.traces_url("c:4317")
    assert not tracing.enabled() and tracing.inject() == [] and tracing.start_span("x") is None
