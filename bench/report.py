"""The printed table and the ``--save-result`` JSON, laid out as ``vllm bench serve`` lays them out.

Called by ``serve.run_bench`` after ``metrics.calculate_metrics``:

    print(format_table(m, run))          # same rows, order and number formats as vLLM
    result = result_json(m, run, outputs) # vLLM's keys in vLLM's order, then "pdserve"

Metric sections and their ``{mean,median,std,pNN}_<metric>_ms`` keys appear for the metrics named
in ``--percentile-metrics`` (default ttft,tpot,itl, as in vLLM; add e2el for end-to-end latency).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pdserve.bench.metrics import BenchmarkMetrics, RequestOutput, Stat

HEADERS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors")


@dataclass(frozen=True)
class RunInfo:
    """What the result JSON says about the run besides the metrics."""

    backend: str
    model_id: str
    tokenizer_id: str
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    duration_s: float
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    goodput: dict[str, float] = field(default_factory=dict)
    label: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    save_detailed: bool = False


def _row(label: str, value: Any, fmt: str = "") -> str:
    return ("{:<40} {:<10" + fmt + "}").format(label, value)


def format_table(m: BenchmarkMetrics, run: RunInfo) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _row("Successful requests:", m.completed), _row("Failed requests:", m.failed)]
    if run.max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", run.max_concurrency))
    if not math.isinf(run.request_rate):
        lines.append(_row("Request rate configured (RPS):", run.request_rate, ".2f"))
    lines += [_row("Benchmark duration (s):", run.duration_s, ".2f"), _row("Total input tokens:", m.total_input),
              _row("Total generated tokens:", m.total_output),
              _row("Request throughput (req/s):", m.request_throughput, ".2f")]
    if run.goodput:
        lines.append(_row("Request goodput (req/s):", m.request_goodput, ".2f"))
    lines += [_row("Output token throughput (tok/s):", m.output_throughput, ".2f"),
              _row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f"),
              _row("Peak concurrent requests:", m.max_concurrent_requests, ".2f"),
              _row("Total token throughput (tok/s):", m.total_token_throughput, ".2f")]
    for name in run.percentile_metrics:
        lines += _stat_lines(name, m.stats[name])
    lines.append("=" * 50)
    return "\n".join(lines)


def _stat_lines(name: str, s: Stat) -> list[str]:
    short, header = HEADERS[name]
    lines = ["{s:{c}^{n}}".format(s=header, n=50, c="-"), _row(f"Mean {short} (ms):", s.mean, ".2f"),
             _row(f"Median {short} (ms):", s.median, ".2f")]
    return lines + [_row(f"P{p_word(p)} {short} (ms):", v, ".2f") for p, v in s.percentiles]


def p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def result_json(m: BenchmarkMetrics, run: RunInfo, outputs: list[RequestOutput],
                date: str | None = None) -> dict[str, Any]:
    """vLLM's ``--save-result`` dict, key for key; the caller adds the ``pdserve`` block."""
    result: dict[str, Any] = {
        "date": date or datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": run.backend,
        "backend": run.backend, "label": run.label, "model_id": run.model_id, "tokenizer_id": run.tokenizer_id,
        "num_prompts": run.num_prompts, **run.metadata,
        "request_rate": run.request_rate if not math.isinf(run.request_rate) else "inf",
        "burstiness": run.burstiness, "max_concurrency": run.max_concurrency, "duration": run.duration_s,
        "completed": m.completed, "failed": m.failed, "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output, "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput if run.goodput else None, "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput}
    if run.save_detailed:
        result.update(_detailed(m, outputs))
    result.update(latencies=[o.latency for o in outputs], queue_times=[o.client_queue_time for o in outputs],
                  max_output_tokens_per_s=m.max_output_tokens_per_s,
                  max_concurrent_requests=m.max_concurrent_requests, rtfx=0.0)
    for name in run.percentile_metrics:
        s = m.stats[name]
        result.update({f"mean_{name}_ms": s.mean, f"median_{name}_ms": s.median, f"std_{name}_ms": s.std})
        result.update({f"p{p_word(p)}_{name}_ms": v for p, v in s.percentiles})
    return result


def _detailed(m: BenchmarkMetrics, outputs: list[RequestOutput]) -> dict[str, Any]:
    return {"input_lens": [o.prompt_len for o in outputs], "output_lens": list(m.output_lens),
            "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
            "start_times": [o.start_time for o in outputs], "generated_texts": [o.generated_text for o in outputs],
            "errors": [o.error for o in outputs]}


def result_filename(run: RunInfo, date: str) -> str:
    """vLLM's default name: ``{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json``."""
    conc = f"-concurrency{run.max_concurrency}" if run.max_concurrency is not None else ""
    return f"{run.label or run.backend}-{run.request_rate}qps{conc}-{run.model_id.split('/')[-1]}-{date}.json"


def format_pdserve(block: dict[str, Any]) -> str:
    """A short section after the table: KV accounting and per-round TTFT (when there is any)."""
    lines = []
    kv = block.get("kv") or {}
    if kv:
        lines.append("{s:{c}^{n}}".format(s="pdserve KV accounting", n=50, c="-"))
        lines += [_row(f"{k}:", v, ".3f" if k.endswith("_rate") else ".0f") for k, v in kv.items()]
    rounds = block.get("rounds") or []
    if len(rounds) > 1:
        lines.append("{s:{c}^{n}}".format(s="Per-round TTFT", n=50, c="-"))
        lines += [_row(f"Round {r['round']} mean / p99 TTFT (ms):", f"{r['mean_ttft_ms']:.2f} / "
                       f"{r['p99_ttft_ms']:.2f}") for r in rounds]
    return "\n".join(lines)
