"""Soak: many short requests through a local cluster (``pdserve serve``'s), some abandoned mid-stream.

Who calls it: tests/test_soak.py (1,000 requests, in CI) and, for the long run outside CI,

    python devbench/soak.py --model DIR --requests 10000 [--concurrency 8] [--disconnect 0.2] [--json out.json]

A fixed-seed request stream (short prompts, 1-16 output tokens, streamed) goes to the proxy with
``concurrency`` clients; a ``disconnect`` fraction of them closes the stream after a random number of
chunks. Figures: completed / failed / disconnected requests, each child's RSS (MiB) after the warm-up
(the first 10 % of requests) and at the end, and its change; the nodes' free KV blocks back to their
starting count and no store object left pinned. Every process is started and stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from pdserve.proxy.cluster import ClusterSpec, LocalCluster

WORDS = "the fox dog river bank dawn walk talk light stone tree wind cloud road house sea".split()


@dataclass
class SoakReport:
    requests: int = 0
    completed: int = 0
    disconnected: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    rss_mib_warm: dict[str, float] = field(default_factory=dict)
    rss_mib_end: dict[str, float] = field(default_factory=dict)
    rss_change: dict[str, float] = field(default_factory=dict)      # end / warm - 1
    blocks_back: bool = False
    pinned_end: float = -1.0
    seconds: float = 0.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _metric(text: str, prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _one(client: httpx.AsyncClient, url: str, rng: random.Random, report: SoakReport, disconnect: float) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
    body = {"prompt": prompt, "max_tokens": rng.randint(1, 16), "temperature": 0.0, "stream": True}
    cut = rng.randint(0, 4) if rng.random() < disconnect else None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            n, done = 0, False
            async for line in r.aiter_lines():
                if '"error"' in line:
                    raise RuntimeError(line[:200])
                done |= line.strip() == "data: [DONE]"
                n += line.startswith("data: ")
                if cut is not None and n > cut:
                    report.disconnected += 1
                    return
            if not done:
                raise RuntimeError("stream ended without [DONE]")
        report.completed += 1
    except Exception as exc:  # noqa: BLE001 - counted and reported
        report.failed += 1
        report.errors.append(f"{type(exc).__name__}: {exc}"[:300])


async def _drive(url: str, n: int, concurrency: int, disconnect: float, seed: int, report: SoakReport,
                 on_warm) -> None:
    rng, queue = random.Random(seed), asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    warm_at = max(1, n // 10)

    async def worker(client):
        while not queue.empty():
            i = queue.get_nowait()
            await _one(client, url, rng, report, disconnect)
            if i == warm_at:
                on_warm()

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))


def run_soak(model: str, requests: int, concurrency: int = 8, disconnect: float = 0.2, seed: int = 0,
             store_bytes: int = 8 << 20) -> SoakReport:
    report = SoakReport(requests=requests)
    spec = ClusterSpec(node_flags=("--kv-chunk-tokens", "32", "--block-size", "16"),
                       store_flags=("--kv-cpu-bytes", str(store_bytes)))       # small: evictions happen
    with LocalCluster(model, spec) as cluster:
        nodes = cluster.prefill_urls + cluster.decode_urls
        blocks0 = {u: _metric(httpx.get(u + "/metrics").text, "pdserve_kv_cache_free_blocks") for u in nodes}

        def snapshot(into: dict) -> None:
            for c in cluster.children:
                into[c.name] = round(rss_mib(c.proc.pid), 1)

        t0 = time.monotonic()
        asyncio.run(_drive(cluster.url, requests, concurrency, disconnect, seed, report,
                           lambda: snapshot(report.rss_mib_warm)))
        report.seconds = time.monotonic() - t0
        report.blocks_back = _wait_blocks_back(nodes, blocks0)
        snapshot(report.rss_mib_end)
        report.rss_change = {k: round(report.rss_mib_end[k] / v - 1, 3) for k, v in report.rss_mib_warm.items() if v}
        decode = cluster.decode_urls[0]
        report.pinned_end = _metric(httpx.get(decode + "/metrics").text, 'pdserve_kvstore_pinned{model_name=')
    return report


def _wait_blocks_back(nodes: list[str], blocks0: dict[str, float], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = {u: _metric(httpx.get(u + "/metrics").text, "pdserve_kv_cache_free_blocks") for u in nodes}
        if now == blocks0:
            return True
        time.sleep(0.2)
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--disconnect", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    report = run_soak(args.model, args.requests, args.concurrency, args.disconnect, args.seed)
    text = json.dumps(asdict(report), indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    ok = report.failed == 0 and report.blocks_back and report.pinned_end == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
