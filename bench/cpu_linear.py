"""fp32 CPU matmuls: oneDNN (``engine.models.layers.linear``, the default) against F.linear (MKL), same run.

    python bench/cpu_linear.py [--rows 1 4 32 256 2048] [--samples 50] [--threads 1] [--output out.json]

The projections of the tiny 4-layer Llama (hidden 256) and of SmolLM2-135M (hidden 576, MLP 1536), each
at each row count; the two paths alternate call by call and each keeps its median, so a shared box's
noise hits both alike. Prints microseconds and F.linear / linear (> 1: the dispatch is faster). Rows
below ``ONEDNN_MIN_ROWS`` go to F.linear in both columns: their ratio is ~1 by construction.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.engine.models.layers import ONEDNN_MIN_ROWS, linear

SHAPES = {"tiny qkv": (256, 512), "tiny o": (256, 256), "tiny gate_up": (256, 256), "tiny down": (128, 256),
          "smol qkv": (576, 960), "smol o": (576, 576), "smol gate_up": (576, 3072), "smol down": (1536, 576)}


def _time(fn, x, w) -> float:
    t = time.perf_counter()
    fn(x, w)
    return time.perf_counter() - t


def measure(rows: list[int], samples: int) -> list[dict]:
    results = []
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k)
        for m in rows:
            x = torch.randn(m, k)
            base, ours = [], []
            for _ in range(3):
                F.linear(x, w), linear(x, w)
            for _ in range(samples):
                base.append(_time(F.linear, x, w))
                ours.append(_time(linear, x, w))
            b, o = statistics.median(base) * 1e6, statistics.median(ours) * 1e6
            results.append({"shape": name, "k": k, "n": n, "rows": m, "f_linear_us": b, "linear_us": o,
                            "speedup": b / o, "gflops": 2 * m * k * n / o / 1e3})
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 256, 2048])
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = measure(args.rows, args.samples)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"oneDNN from {ONEDNN_MIN_ROWS} rows\n")
    print("| shape | k x n | rows | F.linear us | linear us | speedup | GFLOP/s |\n|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | {r['k']}x{r['n']} | {r['rows']} | {r['f_linear_us']:.1f} | {r['linear_us']:.1f} "
              f"| {r['speedup']:.2f} | {r['gflops']:.0f} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"threads": args.threads, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
