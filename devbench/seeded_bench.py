"""Seeded sampling cost: the counter-based batch draw (``engine/runner/seeded.py``) vs the per-row
``torch.Generator`` + ``torch.multinomial`` loop it replaced, in one run on this machine.

    python devbench/seeded_bench.py [--vocab 49152] [--rows 1 16 64 256] [--device cpu]

Prints ms per step for each batch size and the ratio (old / new); the numbers are this box's.
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.engine.runner.seeded import inverse_cdf, seeded_uniform


def per_row_generators(probs: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, gens)])


def counter_based(probs: torch.Tensor, step: int) -> torch.Tensor:
    return inverse_cdf(probs, [seeded_uniform(1000 + i, step) for i in range(probs.shape[0])])


def timed(fn, repeats: int) -> float:
    fn(0)
    start = time.perf_counter()
    for k in range(repeats):
        fn(k + 1)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'rows':>5} {'generators ms':>14} {'counter ms':>11} {'ratio':>6}")
    for rows in args.rows:
        probs = torch.softmax(torch.randn(rows, args.vocab, device=args.device), dim=-1)
        gens = [torch.Generator(device=args.device).manual_seed(1000 + i) for i in range(rows)]
        old = timed(lambda k: per_row_generators(probs, gens), args.repeats)
        new = timed(lambda k: counter_based(probs, k), args.repeats)
        print(f"{rows:>5} {old:>14.2f} {new:>11.2f} {old / new:>6.2f}")


if __name__ == "__main__":
    main()
