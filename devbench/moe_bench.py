"""MoE layer time on this CPU: the grouped matmul by expert vs the per-expert loop (issue 39).

    layer      ``engine.models.moe.MoE`` with random fp32 weights (fixed seed): the router, top-k routing and the
               routed experts; shapes (hidden, expert width, experts, top-k):
                   tiny       64,   32,   8, 2   (``pdserve make-tiny-model --arch qwen3_moe``)
                   v2-lite   2048, 1408,  64, 6   (DeepSeek-V2-Lite's routed experts; --shapes v2-lite, 2.2 GB)
                   scaled     512,  352,  64, 6   (v2-lite's expert count and top-k at a quarter of its widths)
    variants   grouped    what the layer runs on CPU: rows sorted by expert, one ``grouped_mm`` over the expert
                          segments (``moe_ops.grouped_moe``)
               loop       HF transformers' way: for each expert, ``torch.where`` its rows, gather, two matmuls,
                          ``index_add_`` (``moe_ops.loop_moe``, the tests' oracle)
    steps      --tokens rows per call: 1 and 16 (decode steps), 256 and 2048 (prefill chunks)

The process's host memory is tuned as an engine's (``engine/host_memory.tune``: freed activations stay mapped;
without it each call's fresh megabytes fault in again and the grouped path, which allocates a few big buffers where
the loop allocates many small ones, pays ~1 ms more per 2048-token call of the tiny layer).
Each figure is the best of --repeats means over --iters calls at --threads torch threads; each round times both
variants in turn, so a shared box's load drifts over them alike. Outputs are checked against each other. The
ratio is loop / grouped (> 1: grouped faster). Writes --output JSON.
Run: ``python devbench/moe_bench.py [--shapes tiny scaled] [--output moe_bench.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from pdserve.engine import host_memory
from pdserve.engine.models.moe import MoE
from pdserve.engine.models.moe_config import MoEConfig
from pdserve.kernels import moe_ops

SHAPES = {"tiny": (64, 32, 8, 2), "scaled": (512, 352, 64, 6), "v2-lite": (2048, 1408, 64, 6)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moe_bench", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["tiny", "scaled"], choices=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048])
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="best of this many means")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="moe_bench.json")
    return p.parse_args(argv)


def make_layer(shape: str, seed: int) -> MoE:
    hidden, width, experts, top_k = SHAPES[shape]
    cfg = MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=width, norm_topk_prob=True)
    layer = MoE(hidden, cfg, 1, torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return layer


def variants(layer: MoE) -> dict:
    def loop(x):
        weights, ids = layer.route(x)
        return moe_ops.loop_moe(x, layer.w13, layer.w2, weights, ids)
    return {"grouped": layer, "loop": loop}


@torch.no_grad()
def time_step(fns: dict, x: torch.Tensor, iters: int, repeats: int) -> dict[str, float]:
    """-> variant: best mean ms per call; the outputs checked against the first variant's."""
    outs = {name: fn(x) for name, fn in fns.items()}
    first = next(iter(outs.values()))
    for name, out in outs.items():
        torch.testing.assert_close(out, first, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn(x)
            best[name] = min(best[name], (time.perf_counter() - start) / iters * 1e3)
    return best


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tuned = host_memory.tune()          # as every engine process: freed activations stay mapped
    rows = []
    for shape in args.shapes:
        layer = make_layer(shape, args.seed)
        fns = variants(layer)
        for tokens in args.tokens:
            x = torch.randn(tokens, SHAPES[shape][0], generator=torch.Generator().manual_seed(args.seed + tokens))
            ms = time_step(fns, x, args.iters, args.repeats)
            rows.append({"shape": shape, "tokens": tokens, "grouped_ms": round(ms["grouped"], 4),
                         "loop_ms": round(ms["loop"], 4), "loop_over_grouped": round(ms["loop"] / ms["grouped"], 2)})
            print(f"{shape:8} {tokens:5} tokens  grouped {ms['grouped']:9.3f} ms  loop {ms['loop']:9.3f} ms  "
                  f"loop/grouped {ms['loop'] / ms['grouped']:5.2f}")
    result = {"hardware": {"cpu": _cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
                           "torch": torch.__version__, "host_memory_tuned": tuned},
              "shapes": {s: SHAPES[s] for s in args.shapes}, "rows": rows}
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    return result


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
