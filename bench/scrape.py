"""Read the nodes' Prometheus counters before and after a run; the difference is the run's share.

Called by ``serve.run_bench``:

    before = await snapshot(http, urls)         # {counter name: value summed over nodes and labels}
    ... run ...
    block = kv_block(counter_delta(before, await snapshot(http, urls)))

Only ``pdserve_*`` counters and vLLM's prefix-cache counters (``vllm:prefix_cache_*``, which pdserve nodes
export under vLLM's names) are kept (so another server yields an empty or prefix-cache-only block, not an error); a node that does not answer /metrics is skipped with a warning in the block.
``usage_kv`` sums the per-request accounting pdserve puts in each stream's usage chunk, which is
available through the proxy without knowing the nodes.
"""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

KV_PREFIX = "pdserve_kv_"
_KEPT = ("pdserve_", "vllm:prefix_cache_")


async def snapshot(http: aiohttp.ClientSession, urls: list[str]) -> tuple[dict[str, float], list[str]]:
    """({counter: value}, [warnings]) summed over every URL's /metrics."""
    totals: dict[str, float] = {}
    warnings = []
    for url in urls:
        try:
            async with http.get(url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=10.0)) as resp:
                resp.raise_for_status()
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            warnings.append(f"{url}/metrics: {type(exc).__name__}: {exc}")
            continue
        for name, value in parse_counters(text).items():
            totals[name] = totals.get(name, 0.0) + value
    return totals, warnings


def parse_counters(text: str) -> dict[str, float]:
    """``pdserve_*`` and ``vllm:prefix_cache_*`` counter samples (``*_total``) summed over their label sets."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "counter" or not family.name.startswith(_KEPT):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in sorted(after)}


def kv_block(delta: dict[str, float]) -> dict[str, float]:
    """``pdserve_kv_store_hit_tokens_total`` -> ``store_hit_tokens``, plus hit rates when computable."""
    kv = {name[len(KV_PREFIX):-len("_total")]: value for name, value in delta.items()
          if name.startswith(KV_PREFIX)}
    total = kv.get("total_tokens", 0.0)
    if total > 0:
        for key in ("store_hit_tokens", "local_hit_tokens", "loaded_tokens", "recomputed_tokens"):
            if key in kv:
                kv[key.replace("_tokens", "_rate")] = kv[key] / total
    queries = delta.get("vllm:prefix_cache_queries_total", 0.0)
    if queries > 0:
        kv["prefix_cache_hit_rate"] = delta.get("vllm:prefix_cache_hits_total", 0.0) / queries
    return kv


def usage_kv(kv_transfers: list[dict | None]) -> dict[str, dict[str, int]]:
    """Sum of the per-request ``usage.kv_transfer`` figures, per phase ("prefill", "decode", ...)."""
    totals: dict[str, dict[str, int]] = {}
    for kv in kv_transfers:
        for phase, figures in (kv or {}).items():
            if not isinstance(figures, dict):
                continue
            mine = totals.setdefault(phase, {})
            for key, value in figures.items():
                if isinstance(value, (int, float)):
                    mine[key] = mine.get(key, 0) + value
    return totals
