"""Routing by cache vs round robin, same run: TTFT of later chat rounds, and store hits against the ideal.

    python devbench/kv_routing_bench.py [--model DIR] [--users 4 --rounds 3] [--output kv_routing.json]

Two local clusters, one after the other, each ``--prefill 2 --decode 2`` with a store daemon, the same nodes' flags
and the same fixed-seed workloads (``pdserve bench serve``, streaming):
  baseline   the proxy's round_robin for both phases; every request is prefilled on a prefill node
  kv         --routing-policy kv_aware, the store lookup, prefill skipping (full store hit) and
             --local-prefill-threshold: the proxy follows the nodes' KV events
Figures:
  * multi-round (``--dataset-name multi-round``): mean TTFT of rounds >= 2 (request-weighted), kv / baseline
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
    subprocess.run([sys.executable, "-m", "pdserve.engine.cli", "bench", "serve", "--base-url", url,
                    "--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json",
                    "--disable-tqdm", *args], check=True, stdout=subprocess.DEVNULL, cwd=out)
    return json.loads((out / f"{name}.json").read_text())


def later_rounds_ttft(result: dict) -> float:
    rounds = [r for r in result["pdserve"]["rounds"] if r["round"] >= 1]       # rounds 2, 3, ... (0-based 1..)
    return sum(r["mean_ttft_ms"] * r["num_requests"] for r in rounds) / sum(r["num_requests"] for r in rounds)


def metric(url: str, name: str, **labels) -> float:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(l.rsplit(" ", 1)[1]) for l in lines
               if l.startswith(name) and not l.startswith(name + "_created") and
               all(f'{k}="{v}"' in l for k, v in labels.items()))


def multi_round_args(a) -> list[str]:
    return ["--seed", "0", "--dataset-name", "multi-round", "--multi-round-users", str(a.users), "--multi-round-rounds",
            str(a.rounds), "--multi-round-system-len", str(a.system_len), "--multi-round-question-len", "32",
            "--multi-round-answer-len", "32", "--max-concurrency", str(a.users)]


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


def run_cluster(model: str, out: Path, kv: bool, a) -> dict:
    proxy = ("--routing-policy", "kv_aware", "--local-prefill-threshold", str(a.threshold)) if kv else \
        ("--routing-policy", "round_robin")
    spec = ClusterSpec(prefill=2, decode=2, kv_routing=kv, node_flags=NODE_FLAGS, proxy_flags=proxy)
    name = "kv" if kv else "baseline"
    with LocalCluster(model, spec) as c:
        res = {"multi_round": bench(c.url, out, f"{name}-multi-round", multi_round_args(a))}
        res["later_rounds_mean_ttft_ms"] = later_rounds_ttft(res["multi_round"])
        res["decisions"] = {d: metric(c.url, "pdserve_proxy_pd_decisions_total", decision=d)
                            for d in ("prefill", "store_hit", "decode_local")}
        if kv:
            before = metric(c.url, "pdserve_proxy_store_hit_tokens_total")
            bench(c.url, out, "kv-shared-prefix", shared_prefix_args(a))
            got = metric(c.url, "pdserve_proxy_store_hit_tokens_total") - before
            ideal = ideal_store_hits(c.decode_urls[0], model, a)
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
    p.add_argument("--output", default="kv_routing.json")
    a = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="kv-routing-bench-"))
    model = a.model
    if model is None:
        from pdserve.engine.checkpoints.tiny_model import make_tiny_model

        model = str(make_tiny_model(out / "tiny", arch="llama", seed=0))
    base, kv = run_cluster(model, out, False, a), run_cluster(model, out, True, a)
    result = {"hardware": f"{platform.machine()} {os.cpu_count()} cores", "model": model, "baseline": base, "kv": kv,
              "ttft_ratio_rounds_ge_2": kv["later_rounds_mean_ttft_ms"] / base["later_rounds_mean_ttft_ms"],
              "store_hit_vs_ideal": kv["shared_prefix"]["store_hit_tokens_per_request"] /
              max(kv["shared_prefix"]["ideal_per_request"], 1e-9)}
    for name in ("baseline", "kv"):
        r = result[name]
        print(f"{name:9s} mean TTFT rounds >= 2: {r['later_rounds_mean_ttft_ms']:8.1f} ms   decisions {r['decisions']}")
    print(f"TTFT ratio kv / baseline (rounds >= 2): {result['ttft_ratio_rounds_ge_2']:.2f}")
    sp = kv["shared_prefix"]
    print(f"shared prefix: store-hit tokens/request {sp['store_hit_tokens_per_request']:.1f}, ideal "
          f"{sp['ideal_per_request']:.1f}, ratio {result['store_hit_vs_ideal']:.2f}")
    Path(a.output).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
