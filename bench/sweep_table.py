"""The sweep's table: one row per setting, written as markdown, CSV and JSON, plus PNG plots.

Called by ``sweep``: ``row(setting, bench_result, overhead)`` after each setting, then
``write_all(rows, runs, out_dir, params)`` once.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

COLUMNS = ("mode", "pd", "completed", "failed", "request_throughput", "output_throughput",
           "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
           "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "store_hit_tokens", "loaded_tokens", "recomputed_tokens")
OVERHEAD_COLUMNS = ("mean_prefill_ms", "mean_overhead_ms", "p99_overhead_ms", "overhead_over_prefill")


def row(setting, res, overhead: dict | None) -> dict[str, Any]:
    m, kv = res.metrics, res.result["pdserve"]["kv"]
    out: dict[str, Any] = {"setting": setting.name, "mode": setting.mode,
                           "pd": "-" if setting.colocated else f"{setting.prefill}P{setting.decode}D",
                           **dict(setting.node_params), "completed": m.completed, "failed": m.failed,
                           "request_throughput": m.request_throughput, "output_throughput": m.output_throughput}
    for name in ("ttft", "tpot", "itl"):
        s = m.stats[name]
        pct = dict(s.percentiles)
        out.update({f"mean_{name}_ms": s.mean, f"median_{name}_ms": s.median, f"p99_{name}_ms": pct.get(99.0)})
    for key in ("store_hit_tokens", "loaded_tokens", "recomputed_tokens"):
        out[key] = kv.get(key)
    if overhead is not None:
        out.update({k: overhead.get(k) for k in OVERHEAD_COLUMNS})
        out["overhead_failed"] = overhead.get("failed")
    return out


def columns(rows: list[dict[str, Any]]) -> list[str]:
    params = [k for r in rows for k in r if k not in COLUMNS and k != "setting" and k not in OVERHEAD_COLUMNS
              and k != "overhead_failed"]
    extra = [k for k in OVERHEAD_COLUMNS if any(k in r for r in rows)]
    cols = list(COLUMNS[:2]) + list(dict.fromkeys(params)) + list(COLUMNS[2:]) + extra
    return [c for c in cols if any(r.get(c) is not None for r in rows) or c in COLUMNS[:4]]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}" if value.is_integer() else f"{value:.2f}"
    return str(value)


def markdown(rows: list[dict[str, Any]]) -> str:
    cols = columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def write_all(rows: list[dict[str, Any]], runs: dict[str, tuple[dict, list]], out_dir: Path,
              params: dict[str, list[str]], plots: bool = True) -> list[Path]:
    md, csv_path, js = out_dir / "sweep.md", out_dir / "sweep.csv", out_dir / "sweep.json"
    md.write_text(markdown(rows) + "\n")
    cols = columns(rows)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    js.write_text(json.dumps({"rows": rows, "results": {name: result for name, (result, _) in runs.items()}},
                             indent=1, default=str))
    paths = [md, csv_path, js]
    if plots:
        from pdserve.bench.plots import plot_cdfs, plot_sweep

        paths.append(plot_cdfs({name: outputs for name, (_, outputs) in runs.items()}, out_dir / "cdf.png"))
        x = next((k for k in params if k not in ("prefill", "decode")), None)
        x = x or ("pd" if {"prefill", "decode"} & set(params) else "mode")
        paths.append(plot_sweep(rows, out_dir / f"sweep_{x}.png", x))
    return paths
