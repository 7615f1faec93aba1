"""vLLM's disaggregation-overhead method: prefill every prompt on the prefill node, then ask the
decode node for one token with the KV the prefill published; the decode node's TTFT is the
overhead of disaggregation (store lookup + load + one decode step), compared with the prefill's
own time for the same prompt.

Called by ``sweep`` for disaggregated settings when ``--overhead`` is given:

    row = measure_overhead(prefill_url, decode_url, model_name, prompts, backend)

Requests go one at a time (no queueing in either figure), directly to the nodes (no proxy):

    POST prefill /v1/completions  {max_tokens: 1, stream: false, kv_transfer_params: {do_remote_decode}}
        -> prefill_ms, kv_transfer_params
    POST decode  /v1/completions  {max_tokens: 1, stream: true,  kv_transfer_params: <from prefill>}
        -> decode TTFT = overhead_ms
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from pdserve.bench.client import BACKENDS, RequestSpec, send
from pdserve.bench.metrics import stat_ms
from pdserve.bench.runner import make_client

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def measure_overhead(prefill_url: str, decode_url: str, model: str, prompts: list[str],
                     backend: str = "openai") -> dict[str, Any]:
    return asyncio.run(_measure(prefill_url, decode_url, model, prompts, backend))


async def _measure(prefill_url: str, decode_url: str, model: str, prompts: list[str], backend: str) -> dict[str, Any]:
    endpoint = BACKENDS[backend]
    prefill_s, decode_s, errors = [], [], []
    async with make_client(None, timeout_s=600.0) as http:
        for prompt in prompts:
            try:
                elapsed, kv = await _prefill(http, prefill_url + endpoint, model, prompt, backend)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                errors.append(f"prefill: {exc}")
                continue
            spec = RequestSpec(decode_url + endpoint, backend, model, prompt, 0, 1,
                               extra_body={"kv_transfer_params": kv})
            out = await send(http, spec)
            if not out.success:
                errors.append(f"decode: {out.error[:200]}")
                continue
            prefill_s.append(elapsed)
            decode_s.append(out.ttft)
    pre, dec = stat_ms(prefill_s, [99.0]), stat_ms(decode_s, [99.0])
    return {"num_requests": len(prompts), "failed": len(errors), "errors": errors[:5],
            "mean_prefill_ms": pre.mean, "median_prefill_ms": pre.median, "p99_prefill_ms": pre.percentiles[0][1],
            "mean_overhead_ms": dec.mean, "median_overhead_ms": dec.median, "p99_overhead_ms": dec.percentiles[0][1],
            "overhead_over_prefill": dec.mean / pre.mean if pre.mean else None}


async def _prefill(http: aiohttp.ClientSession, url: str, model: str, prompt: str, backend: str):
    body: dict[str, Any] = {"model": model, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    start = time.perf_counter()
    async with http.post(url, json=body) as resp:
        raw = await resp.read()
    elapsed = time.perf_counter() - start
    if resp.status != 200:
        raise ValueError(f"HTTP {resp.status}: {raw.decode(errors='replace')[:200]}")
    kv = json.loads(raw).get("kv_transfer_params")
    if not kv:
        raise ValueError(f"{url} returned no kv_transfer_params; is it a --role prefill node?")
    return elapsed, kv
