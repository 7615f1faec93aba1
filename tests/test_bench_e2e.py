"""End to end: ``pdserve bench serve`` against a local P/D cluster with a tiny model, the
overhead method against its nodes, and a two-setting ``pdserve bench sweep``."""

from __future__ import annotations

import csv
import json

import pytest

from pdserve.bench.datasets import DatasetConfig
from pdserve.bench.overhead import measure_overhead
from pdserve.bench.runner import TrafficConfig
from pdserve.bench.serve import BenchConfig, run_bench
from pdserve.engine.cli import main
from pdserve.proxy.cluster import ClusterSpec, LocalCluster

SHORT = ["--random-input-len", "32", "--random-output-len", "8", "--disable-tqdm"]


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    with LocalCluster(str(tiny_llama), ClusterSpec(startup_timeout_s=120),
                      log_dir=tmp_path_factory.mktemp("bench-cluster")) as c:
        yield c


def test_bench_serve_through_the_proxy(cluster, tmp_path):
    nodes = [arg for url in cluster.prefill_urls + cluster.decode_urls for arg in ("--metrics-url", url)]
    rc = main(["bench", "serve", "--base-url", cluster.url, "--num-prompts", "8", "--num-warmups", "1", *SHORT,
               *nodes, "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
               "--plot", str(tmp_path / "run.png"), "--percentile-metrics", "ttft,tpot,itl,e2el"])
    assert rc == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (8, 0, 64)
    assert r["mean_ttft_ms"] > 0 and r["mean_itl_ms"] > 0 and r["mean_tpot_ms"] > 0
    assert r["output_throughput"] > 0 and r["request_throughput"] > 0
    assert r["mean_e2el_ms"] >= r["mean_ttft_ms"]
    assert r["total_input_tokens"] >= 8 * 24
    kv = r["pdserve"]["kv"]
    assert kv["total_tokens"] > 0 and kv["local_hit_tokens"] + kv["loaded_tokens"] + kv["recomputed_tokens"] \
        == kv["total_tokens"]
    assert r["pdserve"]["usage_kv"]["decode"]["total_tokens"] > 0          # per-request accounting, via the proxy
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multi_round_rounds_and_overhead(cluster):
    cfg = BenchConfig(base_url=cluster.url, dataset=DatasetConfig(
        name="multi-round", multi_round_users=2, multi_round_rounds=2, multi_round_system_len=40,
        multi_round_question_len=8, multi_round_answer_len=4), ignore_eos=True,
        traffic=TrafficConfig(disable_tqdm=True))
    res = run_bench(cfg)
    assert res.metrics.failed == 0 and res.metrics.total_output == 16
    assert [r["round"] for r in res.result["pdserve"]["rounds"]] == [0, 1]
    model = res.result["pdserve"]["model_name"]
    row = measure_overhead(cluster.prefill_urls[0], cluster.decode_urls[0], model,
                           ["the first prompt " * 8, "another prompt " * 12])
    assert row["failed"] == 0, row["errors"]
    assert row["mean_prefill_ms"] > 0 and row["mean_overhead_ms"] > 0


def test_bench_sweep_two_modes(tiny_llama, tmp_path):
    rc = main(["bench", "sweep", "--model", str(tiny_llama), "--mode", "colocated,disagg+warm-store",
               "--param", "max_num_batched_tokens=64", "--num-prompts", "4", *SHORT,
               "--output-dir", str(tmp_path), "--startup-timeout", "120"])
    assert rc == 0
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [(r["mode"], r["max_num_batched_tokens"], r["failed"]) for r in rows] == \
        [("colocated", "64", "0"), ("disagg+warm-store", "64", "0")]
    assert all(float(r["mean_ttft_ms"]) > 0 and float(r["output_throughput"]) > 0 for r in rows)
    assert float(rows[1]["store_hit_tokens"]) > 0                      # the warm pass filled the store
    assert "| colocated |" in (tmp_path / "sweep.md").read_text()
    assert len(json.loads((tmp_path / "sweep.json").read_text())["rows"]) == 2
    assert (tmp_path / "cdf.png").exists() and (tmp_path / "sweep_max_num_batched_tokens.png").exists()
