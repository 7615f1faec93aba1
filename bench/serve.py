"""``pdserve bench serve``: one benchmark run against any OpenAI-compatible server.

Called by ``cli`` (``run_serve(args)``) and by ``sweep`` (``run_bench(config)`` per setting):

    resolve model (GET /v1/models unless --model) -> load tokenizer -> build the dataset -> warmups
    -> snapshot /metrics -> runner.run_requests -> snapshot /metrics -> calculate_metrics
    -> BenchResult(table, result JSON with a "pdserve" block, outputs)

The "pdserve" block holds the KV accounting scraped from ``metrics_urls`` (by default the target
itself; a sweep passes its nodes), the per-round TTFT of round-based datasets and the dataset name.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.bench import scrape
from pdserve.bench.client import RequestSpec
from pdserve.bench.datasets import DatasetConfig, SampleRequest, sample_requests
from pdserve.bench.metrics import BenchmarkMetrics, RequestOutput, calculate_metrics, stat_ms
from pdserve.bench.report import RunInfo, format_pdserve, format_table, result_json
from pdserve.bench.runner import TrafficConfig, make_client, run_requests, run_warmups


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    endpoint: str = "/v1/completions"
    backend: str = "openai"                   # "openai" (completions) or "openai-chat"
    model: str | None = None                  # model id; None: the server's first /v1/models entry
    served_model_name: str | None = None      # name sent in requests; default: the server's id
    tokenizer: str | None = None              # tokenizer dir; default: the model id (a local dir)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    traffic: TrafficConfig = field(default_factory=TrafficConfig)
    ignore_eos: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)      # temperature, top_p, ... sent as is
    headers: dict[str, str] = field(default_factory=dict)
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    percentiles: tuple[float, ...] = (99.0,)
    goodput: dict[str, float] = field(default_factory=dict)
    metrics_urls: tuple[str, ...] = ()        # /metrics to scrape; () -> the target itself
    label: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    save_detailed: bool = False

    @property
    def api_url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


@dataclass
class BenchResult:
    metrics: BenchmarkMetrics
    outputs: list[RequestOutput]
    result: dict[str, Any]
    table: str


def run_bench(cfg: BenchConfig) -> BenchResult:
    return asyncio.run(run_bench_async(cfg))


async def run_bench_async(cfg: BenchConfig) -> BenchResult:
    from pdserve.engine.text.tokenizer import load_tokenizer

    async with make_client(cfg.traffic.max_concurrency) as http:
        model_name, model_id = await resolve_model(http, cfg)
        tokenizer_id = cfg.tokenizer or model_id
        tokenizer = load_tokenizer(_tokenizer_dir(tokenizer_id))
        requests = sample_requests(cfg.dataset, tokenizer)
        specs = [_spec(cfg, model_name, r) for r in requests]
        urls = list(cfg.metrics_urls or (cfg.base_url,))
        await run_warmups(http, specs, cfg.traffic)
        before, warn_before = await scrape.snapshot(http, urls)
        outputs, duration = await run_requests(http, specs, cfg.traffic)
        after, warn_after = await scrape.snapshot(http, urls)
    metrics = calculate_metrics(outputs, duration, list(cfg.percentiles), cfg.goodput, tokenizer)
    run = RunInfo(cfg.backend, model_id, tokenizer_id, len(requests), cfg.traffic.request_rate,
                  cfg.traffic.burstiness, cfg.traffic.max_concurrency, duration, cfg.percentile_metrics,
                  cfg.goodput, cfg.label, cfg.metadata, cfg.save_detailed)
    result = result_json(metrics, run, outputs)
    result["pdserve"] = {"dataset": cfg.dataset.name, "base_url": cfg.base_url, "model_name": model_name,
                         **_kv_figures(urls, before, after, outputs),
                         "rounds": round_stats(outputs), "scrape_warnings": sorted(set(warn_before + warn_after))}
    table = "\n".join(filter(None, [format_table(metrics, run), format_pdserve(result["pdserve"])]))
    return BenchResult(metrics, outputs, result, table)


def _kv_figures(urls: list[str], before: dict[str, float], after: dict[str, float],
                outputs: list[RequestOutput]) -> dict[str, Any]:
    """The run's share of the nodes' counters, and the per-request accounting from the streams."""
    delta = scrape.counter_delta(before, after)
    return {"metrics_urls": urls, "kv": scrape.kv_block(delta),
            "usage_kv": scrape.usage_kv([o.kv_transfer for o in outputs]), "counters": delta}


async def resolve_model(http: aiohttp.ClientSession, cfg: BenchConfig) -> tuple[str, str]:
    """(name sent in requests, model id for the tokenizer), like vLLM: /v1/models' id and root."""
    if cfg.model is not None:
        return cfg.served_model_name or cfg.model, cfg.model
    url = cfg.base_url.rstrip("/") + "/v1/models"
    try:
        async with http.get(url, headers=cfg.headers, timeout=aiohttp.ClientTimeout(total=30.0)) as resp:
            resp.raise_for_status()
            first = json.loads(await resp.read())["data"][0]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as exc:
        raise RuntimeError(f"cannot read the model from {url} ({type(exc).__name__}: {exc}); "
                           "is the server up? or pass --model") from None
    return cfg.served_model_name or first["id"], first.get("root") or first["id"]


def _tokenizer_dir(tokenizer_id: str) -> Path:
    path = Path(tokenizer_id).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer {tokenizer_id!r} is not a local directory; pass --tokenizer DIR "
                                "(the model directory the server loads)")
    return path


def _spec(cfg: BenchConfig, model_name: str, req: SampleRequest) -> RequestSpec:
    return RequestSpec(cfg.api_url, cfg.backend, model_name, req.prompt, req.prompt_len, req.expected_output_len,
                       ignore_eos=cfg.ignore_eos, extra_body=dict(cfg.sampling), headers=dict(cfg.headers),
                       round=req.round, session=req.session, turn=req.turn)


def round_stats(outputs: list[RequestOutput]) -> list[dict[str, float]]:
    """Per dataset round: requests, failures and TTFT (ms) -- cold vs warm for long-doc."""
    rounds = []
    for r in sorted({o.round for o in outputs}):
        mine = [o for o in outputs if o.round == r]
        ttft = stat_ms([o.ttft for o in mine if o.success], [50.0, 99.0])
        rounds.append({"round": r, "num_requests": len(mine), "failed": sum(not o.success for o in mine),
                       "mean_ttft_ms": ttft.mean, "median_ttft_ms": ttft.median,
                       "p99_ttft_ms": ttft.percentiles[1][1]})
    return rounds
