"""``devbench/proxy_overhead.py`` in a reduced run: it starts its cluster, sends both paths in both modes and
writes its JSON. What it measures is never asserted here (timings belong to the bench, not to tests)."""

from __future__ import annotations

import json

from proxy_overhead import MODES, PATHS, main


def test_the_bench_runs_both_paths_and_writes_its_json(tiny_llama, tmp_path):
    out = tmp_path / "overhead.json"
    rc = main(["--model", str(tiny_llama), "--requests", "10", "--warmup", "1", "--disable-tqdm",
               "--output", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and not any(result["failed"].values()), result["errors"]
    for path in PATHS:
        for mode in (*MODES, "all"):
            assert result[path][mode]["n"] == (20 if mode == "all" else 10)
            assert {"p50_ms", "p99_ms", "mean_ms"} <= result[path][mode].keys()
    for mode in (*MODES, "all"):
        assert {"p50_ms", "p99_ms", "paired_median_ms"} <= result["added"][mode].keys()
    assert result["config"]["requests"] == 10 and result["config"]["prompt_tokens"] == 64
