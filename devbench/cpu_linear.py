"""fp32 CPU matmuls: oneDNN (``engine.models.layers.linear``, the default) against F.linear (MKL), same run.

    python devbench/cpu_linear.py [--rows 1 4 32 256 2048] [--samples 50] [--threads 1] [--output out.json]
    python devbench/cpu_linear.py --layers [--rows 2 16 32 256 2048]

The projections of the tiny 4-layer Llama (hidden 256) and of SmolLM2-135M (hidden 576, MLP 1536), each
at each row count; the two paths alternate call by call and each keeps its median, so a shared box's
noise hits both alike. Prints microseconds and F.linear / linear (> 1: the dispatch is faster). One row runs
on oneDNN as a two-row call (``layers._onednn``: the bits it has in any batch).

``--layers``: a whole forward's projections, as a decode step runs them: SmolLM2-135M's 30 layers (qkv, o,
gate_up, down; 424 MB of fp32 weights, so they stream from DRAM as in serving) at each row count, four
ways in turn -- F.linear, oneDNN given the weight as it is (reordered inside every call), oneDNN given the
copy ``Linear`` reordered once, and ``Linear`` itself (the few-row kernel, ``kernels/cpu_linear.py``, at
1-32 rows where the CPU has AVX2; else that copy) -- each the best of --repeats passes, in ms. Before
timing, every layer's ``Linear`` output is checked bit for bit against oneDNN's with the weight as it is
(for one row: the first row of a two-row call).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.engine.models.layers import Linear, linear

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


def measure_layers(rows: list[int], repeats: int, num_layers: int = 30) -> list[dict]:
    """ms for one pass over ``num_layers`` layers' projections per way, at each row count."""
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(num_layers):
        mods = []
        for name in ("smol qkv", "smol o", "smol gate_up", "smol down"):
            k, n = SHAPES[name]
            mod = Linear(k, n, False, torch.float32)
            with torch.no_grad():
                mod.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
            mods.append(mod)
        layers.append(mods)
    ways = {"F.linear": lambda mod, x: F.linear(x, mod.weight),
            "oneDNN, weight as is": lambda mod, x: linear(x, mod.weight),
            "oneDNN, reordered once": lambda mod, x: torch.ops.mkldnn._linear_pointwise(
                x, mod._onednn_weight(), None, "none", [], ""),
            "Linear": lambda mod, x: mod(x)}
    results = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g) for k, _ in SHAPES.values()}
        for mods in layers:
            for mod in mods:
                x = xs[mod.in_size]
                want = linear(torch.cat([x, x]), mod.weight)[:m]          # oneDNN's bits, for one row too
                if not torch.equal(ways["Linear"](mod, x), want):
                    raise AssertionError(f"Linear changed the bits at {m} rows ({tuple(mod.weight.shape)})")
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(repeats + 1):                       # the first pass warms up (and makes Linear's copies)
            for way, fn in ways.items():
                t = time.perf_counter()
                for mods in layers:
                    for mod in mods:
                        fn(mod, xs[mod.in_size])
                best[way] = min(best[way], time.perf_counter() - t)
        results.append({"rows": m, **{way: best[way] * 1e3 for way in ways}})
    return results


def print_layers(results: list[dict]) -> None:
    ways = [k for k in results[0] if k != "rows"]
    print("| rows | " + " | ".join(f"{w} ms" for w in ways) + " | as is / reordered | reordered / Linear |")
    print("|---" * (len(ways) + 3) + "|")
    for r in results:
        print(f"| {r['rows']} | " + " | ".join(f"{r[w]:.1f}" for w in ways)
              + f" | {r[ways[1]] / r[ways[2]]:.2f} | {r[ways[2]] / r[ways[3]]:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 256, 2048])
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=None)
    p.add_argument("--layers", action="store_true", help="SmolLM2's 30 layers per pass, weights streaming")
    p.add_argument("--repeats", type=int, default=3, help="--layers: best of this many passes")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.layers:
        results = measure_layers(args.rows, args.repeats)
        print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
              f"SmolLM2-135M's 30 layers of projections per pass\n")
        print_layers(results)
        if args.output:
            with open(args.output, "w") as f:
                json.dump({"threads": args.threads, "layers": results}, f, indent=1)
        return
    results = measure(args.rows, args.samples)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          "oneDNN at every row count (one row as two)\n")
    print("| shape | k x n | rows | F.linear us | linear us | speedup | GFLOP/s |\n|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | {r['k']}x{r['n']} | {r['rows']} | {r['f_linear_us']:.1f} | {r['linear_us']:.1f} "
              f"| {r['speedup']:.2f} | {r['gflops']:.0f} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"threads": args.threads, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
