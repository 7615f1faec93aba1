"""Rows and the printed table of ``pdserve bench kvstore`` (kvstore_bench.py measures, this divides and prints).

Each path is divided by the baseline of the same size from the same run (``BASELINE``): best GB/s by best GB/s
(``put_ratio``), and the median over rounds of the baseline's time over the path's in the same round
(``put_paired``: both sides of each ratio met the same load); a row whose baseline was not measured (no Redis) is
left out. ``goal`` is issue 40's target for that ratio (None: no target); ``<`` marks a best-by-best ratio below it.
"""

from __future__ import annotations

import os
import platform
import statistics

import torch

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "8MiB": 8 << 20}
BASELINE = {"memcpy": "memcpy", "raw pyzmq": "raw pyzmq", "raw redis-py": "raw redis-py", "memory tier": "memcpy",
            "daemon shm": "memcpy", "daemon tcp": "raw pyzmq", "disk tier (page cache)": "memcpy",
            "redis tier": "raw redis-py"}
GOAL = {"daemon shm": 0.5, "daemon tcp": 0.8, "redis tier": 0.8}


def hardware() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, torch {torch.__version__}, {platform.platform()}"


def row(size: str, path: str, times: dict[str, tuple[list[float], list[float]]], nbytes: int) -> dict:
    """One path's best GB/s and its ratios to its baseline (``times``: path -> (put seconds, get seconds) per round,
    one size; ``nbytes`` moved per call)."""
    base = BASELINE[path]
    (put, get), (bput, bget) = times[path], times[base]
    return {"size": size, "path": path, "baseline": base, "put_gbps": nbytes / min(put) / 1e9,
            "get_gbps": nbytes / min(get) / 1e9, "put_ratio": min(bput) / min(put), "get_ratio": min(bget) / min(get),
            "put_paired": _paired(bput, put), "get_paired": _paired(bget, get), "goal": GOAL.get(path),
            "put_s": put, "get_s": get}


def _paired(base: list[float], path: list[float]) -> float:
    """The median over rounds of the baseline's time over the path's (a ratio of speeds, as ``put_ratio``)."""
    return statistics.median(b / p for b, p in zip(base, path))


def print_table(result: dict) -> None:
    print(f"hardware: {result['hardware']}")
    print(f"{result['total_bytes'] >> 20} MiB per measurement, {result['repeats']} rounds, seed {result['seed']}; "
          "GB/s: the best round; 'x': best over the baseline's best; 'paired': median over rounds of the ratio to "
          "the baseline's time in the same round")
    print(f"{'size':>6} {'path':<23} {'put GB/s':>9} {'get GB/s':>9}  {'baseline':<13} {'put x':>6} {'get x':>6} "
          f"{'put paired':>10} {'get paired':>10} {'goal':>5}")
    for r in result["rows"]:
        goal = f"{r['goal']:.1f}" if r["goal"] else ""
        flag = " <" if r["goal"] and min(r["put_ratio"], r["get_ratio"]) < r["goal"] else ""
        print(f"{r['size']:>6} {r['path']:<23} {r['put_gbps']:9.2f} {r['get_gbps']:9.2f}  {r['baseline']:<13} "
              f"{r['put_ratio']:6.2f} {r['get_ratio']:6.2f} {r['put_paired']:10.2f} {r['get_paired']:10.2f} "
              f"{goal:>5}{flag}")
