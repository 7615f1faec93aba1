"""Tracing's cost: throughput of a local P/D cluster with ``--otlp-traces-endpoint`` vs the same cluster without, one run.

    python devbench/tracing_overhead.py [--model DIR] [--concurrency 1 64] [--requests 32 192] [--rounds 3]
                                       [--max-tokens 16] [--output out.json]

Two local clusters (``LocalCluster``: store daemon, one prefill node, one decode node, the proxy) run side by side
on ``--model`` (default: a generated tiny Llama, seed 0): one with tracing off, one exporting every span of the
proxy and both nodes (OTLP/HTTP, the SDK's batch processor) to a sink in this process that reads and drops each
export (a collector elsewhere costs the cluster nothing more). For each concurrency, each round runs the same
fixed-seed batch of requests (fresh prompts: no prefix is shared between requests) on both clusters, one after the
other (off first in even rounds, on first in odd ones: drift on a shared machine hits both alike), and takes completed requests per second
over the batch, and the CPU seconds the cluster's processes (proxy, nodes, engine cores, store) spent per request
(from /proc: robust where other work shares the machine). The result is the median of the rounds' on/off
throughput ratios (1.00: free; the goal is >= 0.98), the medians of each side and of the CPU per request, as a table
and JSON. ``--control`` runs the second cluster without tracing too: the ratio is then the noise floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from pdserve.proxy.cluster import ClusterSpec, LocalCluster

WORDS = ("the fox dog river bank dawn walk talk light stone tree wind cloud road house sea green "
         "quick slow bright dark over under near far city field hill lake").split()


class Sink:
    """An OTLP/HTTP endpoint that answers 200 and drops what it gets (counts exports and bytes)."""

    def __init__(self):
        self.exports = self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                self.rfile.read(n)
                sink.exports, sink.bytes = sink.exports + 1, sink.bytes + n
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def cpu_seconds(cluster: LocalCluster) -> float:
    """User + system CPU seconds of the cluster's processes and their children (engine cores), from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    pids, todo = set(), [c.proc.pid for c in cluster.children]
    while todo:
        pid = todo.pop()
        pids.add(pid)
        todo += [p for p, parent in parents.items() if parent == pid and p not in pids]
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])          # utime, stime (clock ticks)
        except (OSError, ValueError, IndexError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(48)) for _ in range(n)]


async def run_batch(url: str, texts: list[str], concurrency: int, max_tokens: int) -> float:
    """Completed requests per second for ``texts`` sent ``concurrency`` at a time (every answer checked)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    queue = list(texts)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        async def worker():
            while queue:
                body = {"prompt": queue.pop(), "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
                r = await client.post("/v1/completions", json=body)
                if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != max_tokens:
                    raise RuntimeError(f"bad answer {r.status_code}: {r.text[:300]}")
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(texts) / (time.perf_counter() - start)


def measure(clusters: dict[str, LocalCluster], args) -> list[dict]:
    rows = []
    for concurrency, n in zip(args.concurrency, args.requests):
        asyncio.run(run_batch(clusters["off"].url, prompts(concurrency, 999), concurrency, args.max_tokens))  # warm
        asyncio.run(run_batch(clusters["on"].url, prompts(concurrency, 998), concurrency, args.max_tokens))
        per, cpu = {"off": [], "on": []}, {"off": [], "on": []}
        for r in range(args.rounds):
            texts = prompts(n, seed=1000 * concurrency + r)
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):   # the same prompts (per cluster once);
                before = cpu_seconds(clusters[mode])                       # the order alternates round by round
                per[mode].append(asyncio.run(run_batch(clusters[mode].url, texts, concurrency, args.max_tokens)))
                cpu[mode].append((cpu_seconds(clusters[mode]) - before) / n * 1e3)
        ratios = [on / off for on, off in zip(per["on"], per["off"])]
        rows.append({"concurrency": concurrency, "requests": n, "rounds": args.rounds,
                     "off_req_per_s": statistics.median(per["off"]), "on_req_per_s": statistics.median(per["on"]),
                     "ratio_on_off": statistics.median(ratios), "ratios": ratios, "off": per["off"], "on": per["on"],
                     "off_cpu_ms_per_req": statistics.median(cpu["off"]),
                     "on_cpu_ms_per_req": statistics.median(cpu["on"])})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: a generated tiny Llama)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--requests", type=int, nargs="+", default=[32, 192], help="requests per round, per concurrency")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--control", action="store_true",
                   help="A/A check: the second cluster without tracing too (the ratio is then the noise floor)")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    model = args.model
    if model is None:
        from pdserve.engine.checkpoints.tiny_model import make_tiny_model
        model = str(make_tiny_model(tempfile.mkdtemp(prefix="pdserve-tiny-"), arch="llama", seed=0))
    sink = Sink()
    with ExitStack() as stack:
        trace = () if args.control else ("--otlp-traces-endpoint", sink.url)
        clusters = {"off": stack.enter_context(LocalCluster(model, ClusterSpec(prefill=1, decode=1))),
                    "on": stack.enter_context(LocalCluster(model, ClusterSpec(prefill=1, decode=1, node_flags=trace,
                                                                              proxy_flags=trace)))}
        rows = measure(clusters, args)
    print(f"\ntracing overhead: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{args.max_tokens} output tokens per request, median of {args.rounds} rounds; spans exported: "
          f"{sink.exports} exports, {sink.bytes / 1e6:.1f} MB")
    print(f"{'concurrency':>11} {'off req/s':>10} {'on req/s':>10} {'on/off':>7} {'off CPU ms/req':>15} "
          f"{'on CPU ms/req':>14}  rounds' on/off")
    for r in rows:
        print(f"{r['concurrency']:>11} {r['off_req_per_s']:>10.2f} {r['on_req_per_s']:>10.2f} {r['ratio_on_off']:>7.3f}"
              f" {r['off_cpu_ms_per_req']:>15.2f} {r['on_cpu_ms_per_req']:>14.2f}  "
              f"{' '.join(f'{x:.3f}' for x in r['ratios'])}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"rows": rows, "exports": sink.exports, "export_bytes": sink.bytes}, f, indent=1)


if __name__ == "__main__":
    main()
