"""Benchmark metrics, defined exactly as ``vllm bench serve`` defines them.

Called by ``runner`` (via ``serve``) once every request has finished:

    metrics = calculate_metrics(outputs, duration_s, percentiles=[99.0], goodput={"ttft": 500.0})

Per request (``RequestOutput``, filled by ``client``), all times from ``time.perf_counter``:

    start_time ──ttft──> first SSE chunk with non-empty ``choices``
               ──itl[0]──> next such chunk ──itl[1]──> ... ──> last such chunk  (= start_time + latency)

- TTFT: first chunk carrying ``choices`` (its text may be empty); the usage chunk is not a token.
- ITL: every gap between consecutive ``choices`` chunks, pooled over all requests. A server that
  bundles k tokens into one chunk yields one gap for those k tokens, exactly as vLLM counts it.
- TPOT: (latency - ttft) / (output_tokens - 1), only for requests with > 1 output token.
- output tokens: the stream's usage ``completion_tokens``; without it, the tokenizer's count of
  the generated text; without a tokenizer, 1.
- Peak output tok/s: tokens bucketed per whole second since the first request started, each token
  time = start + ttft + cumulative itl; peak concurrency: a sweep over [start, end) intervals.
- Goodput: requests whose ttft, tpot (0 when <= 1 token) and e2el all meet their SLOs (ms).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_NAMES = ("ttft", "tpot", "e2el")


@dataclass
class RequestOutput:
    """One request's client-side record; ``client`` fills it while the stream arrives."""

    generated_text: str = ""
    success: bool = False
    latency: float = 0.0           # s, start to the last chunk with choices
    output_tokens: int = 0         # usage.completion_tokens; 0 when the server sent no usage
    ttft: float = 0.0              # s
    itl: list[float] = field(default_factory=list)   # s, one per chunk after the first
    prompt_len: int = 0            # usage.prompt_tokens when sent, else the dataset's count
    error: str = ""
    start_time: float = 0.0        # perf_counter when the request was sent
    client_queue_time: float = 0.0  # s waited on --max-concurrency before sending
    round: int = 0                 # dataset round (multi-round / long-doc); 0 otherwise
    kv_transfer: dict | None = None  # pdserve's usage.kv_transfer accounting, when the server sends it


@dataclass(frozen=True)
class Stat:
    """mean / median / std and the selected percentiles of one metric, in ms."""

    mean: float
    median: float
    std: float
    percentiles: tuple[tuple[float, float], ...]   # ((99.0, value_ms), ...)


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    stats: dict[str, Stat]         # "ttft", "tpot", "itl", "e2el"
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    output_lens: tuple[int, ...]   # per request, 0 for failures


def stat_ms(values_s: list[float], percentiles: list[float]) -> Stat:
    """numpy over seconds, times 1000; an empty list counts as [0] (vLLM's ``values or 0``)."""
    data = values_s or 0
    return Stat(mean=float(np.mean(data)) * 1000, median=float(np.median(data)) * 1000,
                std=float(np.std(data)) * 1000,
                percentiles=tuple((p, float(np.percentile(data, p)) * 1000) for p in percentiles))


def output_len(out: RequestOutput, tokenizer=None) -> int:
    if out.output_tokens:
        return out.output_tokens
    if tokenizer is None:
        return 1
    return len(tokenizer(out.generated_text, add_special_tokens=False).input_ids)


def calculate_metrics(outputs: list[RequestOutput], duration_s: float, percentiles: list[float],
                      goodput: dict[str, float] | None = None, tokenizer=None) -> BenchmarkMetrics:
    ok = [o for o in outputs if o.success]
    lens = [output_len(o, tokenizer) if o.success else 0 for o in outputs]
    ok_lens = [n for o, n in zip(outputs, lens) if o.success]
    ttfts = [o.ttft for o in ok]
    e2els = [o.latency for o in ok]
    all_tpots = [_tpot(o, n) for o, n in zip(ok, ok_lens)]
    tpots = [t for t, n in zip(all_tpots, ok_lens) if n > 1]
    itls = [gap for o in ok for gap in o.itl]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(lens)
    good = count_good(goodput or {}, ttfts, all_tpots, e2els)
    peak_tokens, peak_conc = peak_output_and_concurrency(ok)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), total_input=total_input, total_output=total_output,
        request_throughput=len(ok) / duration_s, request_goodput=good / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        stats={"ttft": stat_ms(ttfts, percentiles), "tpot": stat_ms(tpots, percentiles),
               "itl": stat_ms(itls, percentiles), "e2el": stat_ms(e2els, percentiles)},
        max_output_tokens_per_s=peak_tokens, max_concurrent_requests=peak_conc, output_lens=tuple(lens))


def _tpot(out: RequestOutput, n: int) -> float:
    return (out.latency - out.ttft) / (n - 1) if n > 1 else 0.0


def count_good(slo_ms: dict[str, float], ttfts: list[float], tpots: list[float], e2els: list[float]) -> int:
    """Requests meeting every SLO given (``value_s <= slo_ms / 1000``); 0 when no SLO is given."""
    if not slo_ms:
        return 0
    series = {"ttft": ttfts, "tpot": tpots, "e2el": e2els}
    checks = [(series[name], slo / 1000) for name, slo in slo_ms.items()]
    return sum(all(values[i] <= limit for values, limit in checks) for i in range(len(ttfts)))


def token_times(out: RequestOutput) -> list[float]:
    """Arrival times (perf_counter s) of each chunk with choices: start + ttft + cumulative itl."""
    times = [out.start_time + out.ttft]
    for gap in out.itl:
        times.append(times[-1] + gap)
    return times


def peak_output_and_concurrency(ok: list[RequestOutput]) -> tuple[float, int]:
    """(max chunks in any whole second since the first start, max requests open at once).

    The peak concurrency is an exact sweep over half-open [start, end) intervals, ends before starts
    at equal times -- what ``vllm bench serve`` reports as ``max_concurrent_requests`` today (its
    per-second request buckets only feed its terminal plot; older releases reported the bucket count,
    which says 2 for two requests that never overlap but share a second).
    """
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    t_end = max(o.start_time + o.latency for o in ok)
    buckets = np.zeros(int(np.ceil(t_end - t0)) + 1)
    for o in ok:
        for t in token_times(o):
            b = int(t - t0)
            if 0 <= b < len(buckets):
                buckets[b] += 1
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    level = peak = 0
    for _, delta in events:          # at equal times -1 sorts first: intervals are half-open
        level += delta
        peak = max(peak, level)
    return float(buckets.max()), peak


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (ms); bad input names the pair."""
    slo: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep or name not in GOODPUT_NAMES:
            raise ValueError(f"--goodput {pair!r}: expected NAME:MS with NAME one of {', '.join(GOODPUT_NAMES)}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: {value!r} is not a number of milliseconds") from None
        if slo[name] < 0:
            raise ValueError(f"--goodput {pair!r}: the SLO must be >= 0 ms")
    return slo
