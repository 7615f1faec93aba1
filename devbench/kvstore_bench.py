"""KV store benchmark: put/get GB/s per tier and for the daemon (TCP vs shared memory), and the seal's MAC.

Fixed seed; every figure is also printed as a ratio to its baseline measured in the
same run (memcpy for in-process and daemon paths, raw redis-py for the Redis tier).
The daemon runs as ``pdserve serve`` runs it: with a cluster token, every request authenticated.
The seal table puts the keyed MAC (BLAKE3, ``kvstore/seal.py``) beside xxh3 (the old, public
checksum), keyed BLAKE2b (the standard library's) and memcpy, and times ``seal``/``unseal`` whole.
Prints the hardware and the lz4 (+ byte shuffle) compression ratios; ``--json`` writes
the numbers. Run: ``python devbench/kvstore_bench.py [--redis-url ...]`` (the data-plane table alone,
with raw pyzmq as the TCP baseline: ``pdserve bench kvstore``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import blake3
import lz4.block
import redis
import torch
import xxhash

from pdserve.kvstore import codec
from pdserve.kvstore.auth import ClusterKey, new_token
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.redis_tier import RedisTier
from pdserve.kvstore.seal import seal, unseal

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "8MiB": 8 << 20}


def hardware() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, torch {torch.__version__}, {platform.platform()}"


def objects(size: int, total: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, total // size)
    return [(f"bench{size}-{i}:0", torch.randn(size // 2, generator=g).to(torch.bfloat16)) for i in range(n)]


def best_gbps(fn, nbytes: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def memcpy(items) -> tuple[float, float]:
    dst = [torch.empty_like(t) for _, t in items]
    gbps = best_gbps(lambda: [d.copy_(t) for d, (_, t) in zip(dst, items)], _bytes(items))
    return gbps, gbps


def store_put_get(store, items) -> tuple[float, float]:
    keys = [k for k, _ in items]
    put = best_gbps(lambda: store.put(items), _bytes(items))
    got = store.get(keys)
    assert all(g is not None and torch.equal(g, t) for g, (_, t) in zip(got, items)), "round trip failed"
    return put, best_gbps(lambda: store.get(keys), _bytes(items))


def raw_redis(url: str, items) -> tuple[float, float]:
    client = redis.Redis.from_url(url)
    blobs = [("rawbench:" + k, bytes(codec.tensor_bytes(t))) for k, t in items]

    def put():
        pipe = client.pipeline(transaction=False)
        for k, b in blobs:
            pipe.set(k, b)
        pipe.execute()
    put_gbps = best_gbps(put, _bytes(items))
    get_gbps = best_gbps(lambda: client.mget([k for k, _ in blobs]), _bytes(items))
    client.delete(*[k for k, _ in blobs])
    client.close()
    return put_gbps, get_gbps


def start_daemon(cpu_bytes: int, token: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.kvstore", "--port", "0", "--kv-cpu-bytes", str(cpu_bytes),
                             "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PDSERVE_KV_AUTH_TOKEN": token})
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"daemon did not start: {line!r}")
    return proc, line.split()[1]


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


def run(args) -> dict:
    torch.manual_seed(0)
    results: dict = {"hardware": hardware(), "total_bytes": args.total_mib << 20, "rows": []}
    token = new_token()
    daemon, url = start_daemon(4 * (args.total_mib << 20), token)
    tcp, shm = DaemonClient(url, token=token), DaemonClient(url, token=token, shm_bytes=(args.total_mib << 20) + (16 << 20))
    tmp = tempfile.TemporaryDirectory()
    try:
        for label, size in SIZES.items():
            items = objects(size, args.total_mib << 20)
            base = memcpy(items)
            rows = {"memcpy": (base, base), "memory tier": (store_put_get(MemoryTier(1 << 34), items), base),
                    "disk tier (page cache)": (store_put_get(DiskTier(tmp.name, 1 << 34), items), base),
                    "daemon tcp": (store_put_get(tcp, items), base), "daemon shm": (store_put_get(shm, items), base)}
            if args.redis_url:
                raw = raw_redis(args.redis_url, items)
                rows["raw redis-py"] = (raw, raw)
                rows["redis tier"] = (store_put_get(RedisTier(args.redis_url, prefix="bench:"), items), raw)
            for name, ((put, get), (bput, bget)) in rows.items():
                results["rows"].append({"size": label, "path": name, "put_gbps": put, "get_gbps": get,
                                        "put_ratio": put / bput, "get_ratio": get / bget})
    finally:
        tcp.close(), shm.close()
        daemon.terminate(), daemon.wait()
        tmp.cleanup()
    results["lz4_ratio"] = lz4_ratios()
    results["seal"] = seal_rows(args.total_mib << 20)
    return results


def seal_rows(total: int) -> list[dict]:
    """GB/s of each integrity function over the same objects, and of seal/unseal (its MAC + one copy)."""
    key, rows = ClusterKey.random().seal_key, []
    for label, size in SIZES.items():
        items = objects(size, total)
        raws = [codec.tensor_bytes(t) for _, t in items]
        sealed = [seal(k, t, key)[0] for k, t in items]
        fns = {"memcpy": lambda: [d.copy_(t) for d, (_, t) in zip(dst, items)],
               "xxh3_64 (public)": lambda: [xxhash.xxh3_64_intdigest(r) for r in raws],
               "blake2b keyed": lambda: [hashlib.blake2b(r, key=key).digest() for r in raws],
               "blake3 keyed": lambda: [blake3.blake3(r, key=key).digest() for r in raws],
               "seal()": lambda: [seal(k, t, key) for k, t in items],
               "unseal()": lambda: [unseal(k, o, key) for (k, _), o in zip(items, sealed)]}
        dst = [torch.empty_like(t) for _, t in items]
        gbps = {name: best_gbps(fn, _bytes(items)) for name, fn in fns.items()}
        rows += [{"size": label, "fn": name, "gbps": g, "ratio": g / gbps["memcpy"]} for name, g in gbps.items()]
    return rows


def print_results(r: dict) -> None:
    print(f"hardware: {r['hardware']}")
    print(f"{r['total_bytes'] >> 20} MiB moved per measurement, best of 3; ratios vs memcpy (redis tier vs raw redis-py)")
    print(f"{'size':>6} {'path':<24} {'put GB/s':>9} {'get GB/s':>9} {'put x':>7} {'get x':>7}")
    for row in r["rows"]:
        print(f"{row['size']:>6} {row['path']:<24} {row['put_gbps']:9.2f} {row['get_gbps']:9.2f} "
              f"{row['put_ratio']:7.2f} {row['get_ratio']:7.2f}")
    for dtype, ratio in r["lz4_ratio"].items():
        print(f"lz4 ratio {dtype:<9} plain {ratio['plain']:.3f}  byte-shuffled {ratio['shuffled']:.3f}")
    print(f"\nseal: GB/s over the same objects, one thread; ratio vs memcpy")
    print(f"{'size':>6} {'function':<20} {'GB/s':>7} {'x memcpy':>9}")
    for row in r["seal"]:
        print(f"{row['size']:>6} {row['fn']:<20} {row['gbps']:7.2f} {row['ratio']:9.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench kvstore", description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="'' skips the Redis rows")
    p.add_argument("--total-mib", type=int, default=64)
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = run(args)
    print_results(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _bytes(items) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)


if __name__ == "__main__":
    raise SystemExit(main())
