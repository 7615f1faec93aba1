"""Routing by cache vs round robin, same run: TTFT of later chat rounds, and store hits against the ideal.

    python devbench/kv_routing_bench.py [--model DIR] [--users 4 --rounds 3 --repeats 3] [--output kv_routing.json]
                                        [--node-args "..."] [--schedule concurrent|alternating|sequential]

Two local clusters, each ``--prefill 2 --decode 2`` with a store daemon and the same nodes' flags; the same
fixed-seed workloads (``pdserve bench serve``, streaming) run against both, ``--repeats`` times, in one of three
schedules:
  concurrent   (default) both clusters up, each repeat's two workloads at the same time: a shared box's load hits
               both alike -- but on a box with fewer cores than engines the two clusters also share the CPU, so
               the prefills the kv cluster skips hand their CPU to the baseline, which understates the gain
  alternating  both clusters up, each repeat runs one workload after the other (baseline first on even repeats,
               kv first on odd ones), so neither measures while the other computes and drift cancels in pairs
  sequential   one cluster up at a time, a fresh one per repeat, in alternating order: for models whose 8 engines
               do not fit the box at once
The clusters:
  baseline   the proxy's round_robin for both phases; every request is prefilled on a prefill node
  kv         --routing-policy kv_aware, the store lookup, prefill skipping (full store hit) and
             --local-prefill-threshold: the proxy follows the nodes' KV events
Figures:
  * multi-round (``--dataset-name multi-round``): mean TTFT of rounds >= 2 (request-weighted), kv / baseline, over
    the repeats and per repeat. ``--history generated`` (default): each round's prompt carries the answers the
    cluster gave (greedy), as a chat client's does; ``synthetic``: fixed-seed answer tokens in the history
  * shared prefix (``prefix_repetition``, one request at a time, kv cluster): the proxy's store-hit tokens per
    request (``pdserve_proxy_store_hit_tokens``) against the ideal -- for each request, the whole chunks it shares
    with an earlier prompt (the store holds every chunk a prefill published; tokens counted by a node's /tokenize)
Default model: a generated tiny Llama (``pdserve make-tiny-model``), sized for a 2-core box.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from pdserve.proxy.cluster import ClusterSpec, LocalCluster

CHUNK = 64
PREFIX_SEED = 1     # not the multi-round run's 0: its system prompt (the same first draw) would be in the store already
NODE_FLAGS = ("--kv-chunk-tokens", str(CHUNK), "--max-num-batched-tokens", "512")


def bench(url: str, out: Path, name: str, args: list[str]) -> dict:
    return benches([(url, name, args)], out)[0]


def benches(runs: list[tuple[str, str, list[str]]], out: Path) -> list[dict]:
    """``pdserve bench serve`` once per (url, name, args), all at the same time; their result JSONs."""
    procs = [subprocess.Popen([sys.executable, "-m", "pdserve.engine.cli", "bench", "serve", "--base-url", url,
                               "--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json",
                               "--disable-tqdm", *args], stdout=subprocess.DEVNULL, cwd=out)
             for url, name, args in runs]
    for proc in procs:
        if proc.wait() != 0:
            raise RuntimeError(f"pdserve bench serve exited with {proc.returncode}")
    return [json.loads((out / f"{name}.json").read_text()) for _, name, _ in runs]


def later_rounds_ttft(result: dict) -> float:
    rounds = [r for r in result["pdserve"]["rounds"] if r["round"] >= 1]       # rounds 2, 3, ... (0-based 1..)
    return sum(r["mean_ttft_ms"] * r["num_requests"] for r in rounds) / sum(r["num_requests"] for r in rounds)


def metric(url: str, name: str, **labels) -> float:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(l.rsplit(" ", 1)[1]) for l in lines
               if l.startswith(name) and not l.startswith(name + "_created") and
               all(f'{k}="{v}"' in l for k, v in labels.items()))


def multi_round_args(a, seed: int) -> list[str]:
    return ["--seed", str(seed), "--dataset-name", "multi-round", "--multi-round-users", str(a.users), "--multi-round-rounds",
            str(a.rounds), "--multi-round-system-len", str(a.system_len), "--multi-round-question-len", str(a.question_len),
            "--multi-round-answer-len", str(a.answer_len), "--max-concurrency", str(a.users),
            "--multi-round-history", a.history, *(("--temperature", "0") if a.history == "generated" else ())]


def shared_prefix_args(a) -> list[str]:
    return ["--seed", str(PREFIX_SEED), "--dataset-name", "prefix_repetition", "--num-prompts", str(a.prefix_prompts),
            "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-prefix-len", str(a.system_len),
            "--prefix-repetition-suffix-len", "64", "--prefix-repetition-output-len", "8", "--max-concurrency", "1"]


def ideal_store_hits(node_url: str, model: str, a) -> list[int]:
    """Per request, in order: the whole chunks its prompt shares with an earlier one."""
    from pdserve.bench.dataset_base import DatasetConfig
    from pdserve.bench.datasets import sample_requests
    from pdserve.engine.text.tokenizer import load_tokenizer

    cfg = DatasetConfig(name="prefix_repetition", num_prompts=a.prefix_prompts, seed=PREFIX_SEED,
                        prefix_repetition_num_prefixes=2, prefix_repetition_prefix_len=a.system_len,
                        prefix_repetition_suffix_len=64, prefix_repetition_output_len=8)
    seen, out = [], []
    for req in sample_requests(cfg, load_tokenizer(model)):
        ids = httpx.post(node_url + "/tokenize", json={"prompt": req.prompt}, timeout=30).json()["tokens"]
        lcp = max((_common(ids, s) for s in seen), default=0)
        out.append(min(lcp // CHUNK * CHUNK, len(ids)) if lcp < len(ids) else len(ids))
        seen.append(ids)
    return out


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def spec(kv: bool, a) -> ClusterSpec:
    proxy = ("--routing-policy", "kv_aware", "--local-prefill-threshold", str(a.threshold)) if kv else \
        ("--routing-policy", "round_robin")
    return ClusterSpec(prefill=2, decode=2, kv_routing=kv, node_flags=NODE_FLAGS + tuple(shlex.split(a.node_args)),
                       proxy_flags=proxy)


def decisions(url: str) -> dict[str, float]:
    return {d: metric(url, "pdserve_proxy_pd_decisions_total", decision=d) for d in ("prefill", "store_hit",
                                                                                      "decode_local")}


def run_sequential(model: str, out: Path, a) -> dict:
    """``--schedule sequential``: one cluster up at a time, for models whose 8 engines do not fit the box at once.
    Each repeat starts a fresh cluster of each kind, in alternating order (baseline first on even repeats), runs the
    workload and stops it: no two clusters ever share the box, and drift in the box's load cancels in pairs. No
    shared-prefix part."""
    res = {name: {"later_rounds_mean_ttft_ms": [], "decisions": {}} for name in ("baseline", "kv")}
    for i in range(a.repeats):
        for name in (("baseline", "kv") if i % 2 == 0 else ("kv", "baseline")):
            with LocalCluster(model, spec(name == "kv", a)) as c:
                result = bench(c.url, out, f"{name}-multi-round-{i}", multi_round_args(a, 10 + i))
                res[name]["later_rounds_mean_ttft_ms"].append(later_rounds_ttft(result))
                for decision, n in decisions(c.url).items():
                    res[name]["decisions"][decision] = res[name]["decisions"].get(decision, 0.0) + n
    res["shared_prefix"] = {"store_hit_tokens_per_request": 0.0, "ideal_per_request": 0.0}
    return res


def run(model: str, out: Path, a) -> dict:
    """Both clusters up at once; each repeat runs the multi-round workload (fresh prompts: seed 10 + i) against both,
    at the same time (``concurrent``: both see the same machine load, and each other's, alike) or one after the other
    in alternating order (``alternating``)."""
    ttft: dict[str, list[float]] = {"baseline": [], "kv": []}
    with LocalCluster(model, spec(False, a)) as base, LocalCluster(model, spec(True, a)) as kv:
        clusters = {"baseline": base, "kv": kv}
        for i in range(a.repeats):
            runs = [(c.url, f"{name}-multi-round-{i}", multi_round_args(a, 10 + i)) for name, c in clusters.items()]
            if a.schedule == "concurrent":
                results = benches(runs, out)
            else:
                order = [0, 1] if i % 2 == 0 else [1, 0]
                done = {j: bench(runs[j][0], out, runs[j][1], runs[j][2]) for j in order}
                results = [done[0], done[1]]
            for name, result in zip(clusters, results):
                ttft[name].append(later_rounds_ttft(result))
        res = {name: {"later_rounds_mean_ttft_ms": ttft[name], "decisions": decisions(c.url)}
               for name, c in clusters.items()}
        before = metric(kv.url, "pdserve_proxy_store_hit_tokens_total")
        bench(kv.url, out, "kv-shared-prefix", shared_prefix_args(a))
        got = metric(kv.url, "pdserve_proxy_store_hit_tokens_total") - before
        ideal = ideal_store_hits(kv.decode_urls[0], model, a)
        res["shared_prefix"] = {"store_hit_tokens_per_request": got / len(ideal),
                                "ideal_per_request": sum(ideal) / len(ideal)}
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: a generated tiny Llama)")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--threshold", type=int, default=128, help="the kv run's --local-prefill-threshold")
    p.add_argument("--prefix-prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="multi-round runs per cluster, alternating")
    p.add_argument("--node-args", default="", help="more flags for every node, e.g. \"--kv-cache-memory-bytes "
                   "268435456\" (8 nodes at once: a real model's default KV cache may not fit the box)")
    p.add_argument("--question-len", type=int, default=32, help="multi-round question tokens per round")
    p.add_argument("--answer-len", type=int, default=32, help="multi-round answer tokens per round (in the history)")
    p.add_argument("--history", choices=("generated", "synthetic"), default="generated",
                   help="multi-round history: the server's own answers, greedy (a chat client; LMCache's multi-round "
                   "QA), or fixed-seed answer tokens (--multi-round-history of pdserve bench serve)")
    p.add_argument("--schedule", choices=("concurrent", "alternating", "sequential"), default="concurrent",
                   help="how the two clusters' workloads are run (see the module's docstring)")
    p.add_argument("--output", default="kv_routing.json")
    a = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="kv-routing-bench-"))
    model = a.model
    if model is None:
        from pdserve.engine.checkpoints.tiny_model import make_tiny_model

        model = str(make_tiny_model(out / "tiny", arch="llama", seed=0))
    res = (run_sequential if a.schedule == "sequential" else run)(model, out, a)
    base, kv = (sum(res[n]["later_rounds_mean_ttft_ms"]) / a.repeats for n in ("baseline", "kv"))
    pairs = [k / b for k, b in zip(res["kv"]["later_rounds_mean_ttft_ms"], res["baseline"]["later_rounds_mean_ttft_ms"])]
    sp = res["shared_prefix"]
    result = {"hardware": f"{platform.machine()} {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}",
              "schedule": a.schedule, "history": a.history,
              "model": model, **res, "ttft_ratio_rounds_ge_2": kv / base, "ttft_ratio_per_repeat": pairs,
              "store_hit_vs_ideal": sp["store_hit_tokens_per_request"] / max(sp["ideal_per_request"], 1e-9)}
    for name, mean in (("baseline", base), ("kv", kv)):
        runs = ", ".join(f"{t:.1f}" for t in res[name]["later_rounds_mean_ttft_ms"])
        print(f"{name:9s} mean TTFT rounds >= 2: {mean:8.1f} ms  (runs {runs})  decisions {res[name]['decisions']}")
    print(f"TTFT ratio kv / baseline (rounds >= 2): {result['ttft_ratio_rounds_ge_2']:.2f}  "
          f"(per repeat {', '.join(f'{r:.2f}' for r in pairs)})")
    print(f"shared prefix: store-hit tokens/request {sp['store_hit_tokens_per_request']:.1f}, ideal "
          f"{sp['ideal_per_request']:.1f}, ratio {result['store_hit_vs_ideal']:.2f}")
    Path(a.output).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
