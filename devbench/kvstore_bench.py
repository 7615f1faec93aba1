"""The KV store's integrity and compression costs: the seal's keyed MAC beside the alternatives, and lz4's ratios.

The data-plane table (put/get GB/s per tier and for the daemon over TCP and shared memory, against memcpy, raw
pyzmq and raw redis-py) is ``pdserve bench kvstore`` (``bench/kvstore_bench.py``, whose helpers this reuses).
Here, fixed seed, one thread: the seal table puts the keyed MAC (BLAKE3, ``kvstore/seal.py``) beside xxh3 (the
old, public checksum), keyed BLAKE2b (the standard library's) and memcpy, and times ``seal``/``unseal`` whole,
each as a ratio to memcpy over the same objects; then lz4's compression ratios, plain and byte-shuffled.
Run: ``python devbench/kvstore_bench.py [--total-mib 64] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import blake3
import lz4.block
import torch
import xxhash

from pdserve.bench.kvstore_bench import objects, total_of
from pdserve.bench.kvstore_table import SIZES, hardware
from pdserve.kvstore import codec
from pdserve.kvstore.auth import ClusterKey
from pdserve.kvstore.seal import seal, unseal

REPEATS = 3


def best_gbps(fn, nbytes: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def lz4_ratios(seed: int = 0) -> dict[str, dict[str, float]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(256, 1024, generator=g)
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        raw = bytes(codec.tensor_bytes(base.to(dtype)))
        plain = len(lz4.block.compress(raw, store_size=False))
        shuffled = len(codec.encode(base.to(dtype), "lz4", "bench:0")) - codec.HEADER_BYTES
        out[str(dtype).removeprefix("torch.")] = {"plain": len(raw) / plain, "shuffled": len(raw) / shuffled}
    return out


def seal_rows(total: int) -> list[dict]:
    """GB/s of each integrity function over the same objects, and of seal/unseal (its MAC + one copy)."""
    key, rows = ClusterKey.random().seal_key, []
    for label, size in SIZES.items():
        items = objects(size, total, seed=0)
        raws = [codec.tensor_bytes(t) for _, t in items]
        sealed = [seal(k, t, key)[0] for k, t in items]
        dst = [torch.empty_like(t) for _, t in items]
        fns = {"memcpy": lambda: [d.copy_(t) for d, (_, t) in zip(dst, items)],
               "xxh3_64 (public)": lambda: [xxhash.xxh3_64_intdigest(r) for r in raws],
               "blake2b keyed": lambda: [hashlib.blake2b(r, key=key).digest() for r in raws],
               "blake3 keyed": lambda: [blake3.blake3(r, key=key).digest() for r in raws],
               "seal()": lambda: [seal(k, t, key) for k, t in items],
               "unseal()": lambda: [unseal(k, o, key) for (k, _), o in zip(items, sealed)]}
        gbps = {name: best_gbps(fn, total_of(items), REPEATS) for name, fn in fns.items()}
        rows += [{"size": label, "fn": name, "gbps": g, "ratio": g / gbps["memcpy"]} for name, g in gbps.items()]
    return rows


def print_results(r: dict) -> None:
    print(f"hardware: {r['hardware']}")
    print(f"seal: GB/s over the same objects ({r['total_bytes'] >> 20} MiB, best of {REPEATS}), one thread; "
          f"ratio vs memcpy")
    print(f"{'size':>6} {'function':<20} {'GB/s':>7} {'x memcpy':>9}")
    for row in r["seal"]:
        print(f"{row['size']:>6} {row['fn']:<20} {row['gbps']:7.2f} {row['ratio']:9.2f}")
    for dtype, ratio in r["lz4_ratio"].items():
        print(f"lz4 ratio {dtype:<9} plain {ratio['plain']:.3f}  byte-shuffled {ratio['shuffled']:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="devbench/kvstore_bench.py", description=__doc__.splitlines()[0])
    p.add_argument("--total-mib", type=int, default=64)
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    results = {"hardware": hardware(), "total_bytes": args.total_mib << 20,
               "seal": seal_rows(args.total_mib << 20), "lz4_ratio": lz4_ratios()}
    print_results(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
