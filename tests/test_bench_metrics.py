"""Metric computations on synthetic timelines with known answers (vLLM's definitions)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.metrics import (RequestOutput, calculate_metrics, count_good, parse_goodput,
                                   peak_output_and_concurrency, token_times)
from pdserve.bench.runner import arrival_times


def req(start, ttft, itl, tokens, prompt_len=10, success=True, text=""):
    return RequestOutput(generated_text=text, success=success, latency=ttft + sum(itl), output_tokens=tokens,
                         ttft=ttft, itl=list(itl), prompt_len=prompt_len, start_time=start)


def test_one_token_per_chunk():
    # A: ttft 0.1 s, then 3 tokens 0.02 s apart (4 tokens); B: ttft 0.3 s, 2 tokens 0.04 s apart.
    a, b = req(0.0, 0.1, [0.02, 0.02, 0.02], 4), req(0.5, 0.3, [0.04], 2, prompt_len=30)
    m = calculate_metrics([a, b], duration_s=2.0, percentiles=[50.0, 99.0])
    assert (m.completed, m.failed, m.total_input, m.total_output) == (2, 0, 40, 6)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(3.0)
    assert m.total_token_throughput == pytest.approx(23.0)
    assert m.stats["ttft"].mean == pytest.approx(200.0)
    assert m.stats["ttft"].median == pytest.approx(200.0)
    assert m.stats["tpot"].mean == pytest.approx(30.0)          # (20 + 40) / 2
    assert m.stats["itl"].mean == pytest.approx(25.0)           # pooled gaps: 20, 20, 20, 40
    assert m.stats["itl"].median == pytest.approx(20.0)
    assert m.stats["e2el"].mean == pytest.approx((160 + 340) / 2)
    assert dict(m.stats["ttft"].percentiles)[99.0] == pytest.approx(np.percentile([100, 300], 99))
    assert m.stats["tpot"].std == pytest.approx(10.0)


def test_server_bundling_tokens_per_chunk():
    # 10 tokens in 4 chunks: 1 + 3 + 3 + 3 tokens; first chunk at 0.2 s, then every 0.06 s.
    r = req(0.0, 0.2, [0.06, 0.06, 0.06], tokens=10)
    m = calculate_metrics([r], duration_s=1.0, percentiles=[99.0])
    assert m.total_output == 10                                  # from usage, not from the chunk count
    assert m.stats["tpot"].mean == pytest.approx(0.18 / 9 * 1000)  # 20 ms: (latency - ttft) / (tokens - 1)
    assert m.stats["itl"].mean == pytest.approx(60.0)            # one gap per chunk, as vLLM counts it
    assert m.stats["e2el"].mean == pytest.approx(380.0)
    assert m.max_output_tokens_per_s == 4.0                      # chunks per second bucket, not tokens


def test_failures_are_excluded_and_single_token_has_no_tpot():
    ok = req(0.0, 0.05, [], tokens=1)
    bad = RequestOutput(success=False, error="HTTP 500", prompt_len=99)
    m = calculate_metrics([ok, bad], duration_s=0.5, percentiles=[99.0])
    assert (m.completed, m.failed, m.total_input, m.output_lens) == (1, 1, 10, (1, 0))
    assert m.stats["tpot"].mean == 0.0 and m.stats["itl"].mean == 0.0    # empty lists count as [0]
    assert m.stats["ttft"].mean == pytest.approx(50.0)


def test_output_len_falls_back_to_tokenizer_then_one():
    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return type("Enc", (), {"input_ids": text.split()})()

    r = req(0.0, 0.1, [0.01], tokens=0, text="a b c")
    assert calculate_metrics([r], 1.0, [99.0], tokenizer=Tok()).total_output == 3
    assert calculate_metrics([r], 1.0, [99.0]).total_output == 1


def test_peak_buckets_and_half_open_concurrency():
    a = req(0.0, 0.5, [0.2, 0.2], 3)            # tokens at 0.5, 0.7, 0.9 -> bucket 0; ends at 0.9
    b = req(0.9, 0.3, [0.5, 0.1], 3)            # starts exactly when a ends; tokens at 1.2, 1.7, 1.8
    assert token_times(b) == pytest.approx([1.2, 1.7, 1.8])
    peak_tokens, peak_conc = peak_output_and_concurrency([a, b])
    assert peak_tokens == 3.0
    assert peak_conc == 1                        # [0, 0.9) and [0.9, 1.8) never overlap
    c = req(0.1, 0.1, [], 1)
    assert peak_output_and_concurrency([a, b, c])[1] == 2


def test_goodput():
    a, b, c = req(0, 0.1, [0.01], 2), req(0, 0.4, [0.01], 2), req(0, 0.1, [0.2], 2)
    m = calculate_metrics([a, b, c], duration_s=2.0, percentiles=[99.0], goodput={"ttft": 200, "tpot": 50})
    assert m.request_goodput == pytest.approx(0.5)       # only a meets both SLOs
    assert count_good({}, [0.1], [0.0], [0.1]) == 0
    assert count_good({"e2el": 150}, [0.1, 0.1], [0.0, 0.0], [0.15, 0.2]) == 1   # <= counts as good
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_arrival_times():
    rng = np.random.default_rng(0)
    assert arrival_times(4, math.inf, 1.0, rng) == [0.0] * 4
    assert arrival_times(4, 2.0, math.inf, rng) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    times = arrival_times(100, 10.0, 0.5, rng)
    assert times[-1] == pytest.approx(10.0) and all(x <= y for x, y in zip(times, times[1:]))
    same = arrival_times(100, 10.0, 0.5, np.random.default_rng(0))
    assert arrival_times(100, 10.0, 0.5, np.random.default_rng(0)) == same     # fixed seed, same schedule
    assert arrival_times(0, 1.0, 1.0, rng) == []
