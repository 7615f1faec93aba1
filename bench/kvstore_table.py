"""Rows and the printed table of ``pdserve bench kvstore`` (kvstore_bench.py measures, this divides and prints).

Each path is divided by the baseline of the same size from the same run (``BASELINE``); a row whose baseline
was not measured (no Redis) is left out. ``goal`` is issue 40's target for that ratio (None: no target).
"""

from __future__ import annotations

import os
import platform

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


def row(size: str, path: str, figures: dict[str, tuple[float, float]]) -> dict:
    """One path's GB/s and its ratios to its baseline (``figures``: path -> (put GB/s, get GB/s), one size)."""
    (put, get), base = figures[path], BASELINE[path]
    bput, bget = figures[base]
    return {"size": size, "path": path, "baseline": base, "put_gbps": put, "get_gbps": get,
            "put_ratio": put / bput, "get_ratio": get / bget, "goal": GOAL.get(path)}


def print_table(result: dict) -> None:
    print(f"hardware: {result['hardware']}")
    print(f"{result['total_bytes'] >> 20} MiB per measurement, best of {result['repeats']}, seed {result['seed']}; "
          "each ratio against its baseline from this run")
    print(f"{'size':>6} {'path':<23} {'put GB/s':>9} {'get GB/s':>9}  {'baseline':<13} {'put x':>6} {'get x':>6} "
          f"{'goal':>5}")
    for r in result["rows"]:
        goal = f"{r['goal']:.1f}" if r["goal"] else ""
        flag = " <" if r["goal"] and min(r["put_ratio"], r["get_ratio"]) < r["goal"] else ""
        print(f"{r['size']:>6} {r['path']:<23} {r['put_gbps']:9.2f} {r['get_gbps']:9.2f}  {r['baseline']:<13} "
              f"{r['put_ratio']:6.2f} {r['get_ratio']:6.2f} {goal:>5}{flag}")
