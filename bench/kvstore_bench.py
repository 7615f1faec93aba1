"""``pdserve bench kvstore``: the KV store's data plane against raw baselines measured in the same run.

Who calls it: ``bench/cli.py`` (``pdserve bench kvstore``); ``python -m pdserve.bench.kvstore_bench`` runs
the same. Each row moves ``--total-mib`` of objects of one size (64 KiB, 1 MiB, 8 MiB; fixed ``--seed``) in
one batched call, best of ``--repeats``, and is divided by its baseline from this run. The objects are
sealed (kvstore/seal.py) as every KV object a node stores is; ``--unsealed`` moves plain tensors instead:

    path                 baseline          what the baseline is
    memory tier          memcpy            torch copy_ of the same tensors
    daemon shm           memcpy            (a same-host client of ``pdserve kvstore``: the arena)
    daemon tcp           raw pyzmq         DEALER -> ROUTER in another process, the objects as frames
    redis tier           raw redis-py      a pipeline of SETs of bytes / one MGET
    disk tier            memcpy            (page cache)

The daemon runs as ``pdserve serve`` runs it: its own process, a cluster token, every request signed.
Progress goes to stderr; ``--json PATH`` writes every figure. Rows and printing: kvstore_table.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import zmq

from pdserve.bench.kvstore_table import BASELINE, SIZES, hardware, print_table, row

RAW_ZMQ_SERVER = """
import sys, zmq
from pdserve.engine import host_memory; host_memory.tune()   # as the daemon and the bench process: a fair baseline
sock = zmq.Context().socket(zmq.ROUTER); sock.setsockopt(zmq.LINGER, 0)
port = sock.bind_to_random_port("tcp://127.0.0.1"); print(port, flush=True)
kept = []
while True:
    ident, op, *frames = sock.recv_multipart(copy=False)
    if op.bytes == b"put":
        kept = frames; sock.send_multipart([ident, b"ok"], copy=False)
    elif op.bytes == b"get":
        sock.send_multipart([ident, b"ok", *kept], copy=False)
    else:
        break
"""


def objects(size: int, total: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, total // size)
    return [(f"bench{size}-{seed}-{i}:0", torch.randn(size // 2, generator=g).to(torch.bfloat16)) for i in range(n)]


def sealed_objects(size: int, total: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """``objects`` as the store holds them in a cluster: each sealed for its key (kvstore/seal.py, a random seal
    key), ``size`` bytes in all (seal header included). The transport skips its digest for these (protocol.py)."""
    from pdserve.kvstore.auth import ClusterKey
    from pdserve.kvstore.seal import SEAL_BYTES, seal

    key = ClusterKey.random().seal_key
    return [(k, seal(k, t[:(size - SEAL_BYTES) // 2], key)[0]) for k, t in objects(size, total, seed)]


def best_gbps(fn, nbytes: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def memcpy(items, repeats: int) -> tuple[float, float]:
    dst = [torch.empty_like(t) for _, t in items]
    gbps = best_gbps(lambda: [d.copy_(t) for d, (_, t) in zip(dst, items)], _bytes(items), repeats)
    return gbps, gbps


def store_put_get(store, items, repeats: int) -> tuple[float, float]:
    keys = [k for k, _ in items]
    put = best_gbps(lambda: store.put(items), _bytes(items), repeats)
    got = store.get(keys)
    if not all(g is not None and torch.equal(g, t) for g, (_, t) in zip(got, items)):
        raise RuntimeError(f"{type(store).__name__}: a round trip did not return the bytes put")
    return put, best_gbps(lambda: store.get(keys), _bytes(items), repeats)


def raw_redis(url: str, items, repeats: int) -> tuple[float, float]:
    import redis

    client = redis.Redis.from_url(url)
    blobs = [("rawbench:" + k, t.view(torch.uint8).numpy().tobytes()) for k, t in items]

    def put():
        pipe = client.pipeline(transaction=False)
        for k, b in blobs:
            pipe.set(k, b)
        pipe.execute()
    put_gbps = best_gbps(put, _bytes(items), repeats)
    get_gbps = best_gbps(lambda: client.mget([k for k, _ in blobs]), _bytes(items), repeats)
    client.delete(*[k for k, _ in blobs])
    client.close()
    return put_gbps, get_gbps


def raw_zmq(url: str, items, repeats: int) -> tuple[float, float]:
    """What pyzmq itself moves: the objects as frames of one message to a ROUTER in another process, and back."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    frames = [t.view(torch.uint8).numpy() for _, t in items]

    def put():
        sock.send_multipart([b"put", *frames], copy=False)
        sock.recv_multipart(copy=False)

    def get():
        sock.send_multipart([b"get"])
        return sock.recv_multipart(copy=False)[1:]
    put_gbps = best_gbps(put, _bytes(items), repeats)
    get_gbps = best_gbps(get, _bytes(items), repeats)
    sock.close()
    return put_gbps, get_gbps


def start_daemon(cpu_bytes: int, token: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.kvstore", "--port", "0", "--kv-cpu-bytes", str(cpu_bytes),
                             "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PDSERVE_KV_AUTH_TOKEN": token})
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"the KV daemon did not start: {line!r}")
    return proc, line.split()[1]


def start_raw_zmq() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", RAW_ZMQ_SERVER], stdout=subprocess.PIPE, text=True)
    return proc, f"tcp://127.0.0.1:{int(proc.stdout.readline())}"


def run(args) -> dict:
    from pdserve.engine import host_memory
    from pdserve.kvstore.auth import new_token
    from pdserve.kvstore.client import DaemonClient
    from pdserve.kvstore.disk import DiskTier
    from pdserve.kvstore.memory import MemoryTier
    from pdserve.kvstore.redis_tier import RedisTier

    host_memory.tune()       # every process here keeps freed memory mapped, as nodes and the daemon do
    total, token, rep = args.total_mib << 20, new_token(), args.repeats
    sizes = {label: SIZES[label] for label in args.sizes.split(",")}
    daemon, url = start_daemon(4 * total, token)
    raw_proc, raw_url = start_raw_zmq()
    tcp, shm = DaemonClient(url, token=token), DaemonClient(url, token=token, shm_bytes=total + (16 << 20))
    tmp = tempfile.TemporaryDirectory()
    result = {"hardware": hardware(), "total_bytes": total, "repeats": rep, "seed": args.seed, "rows": []}
    try:
        for n, (label, size) in enumerate(sizes.items()):
            items = (objects if args.unsealed else sealed_objects)(size, total, args.seed)
            steps = {"memcpy": lambda: memcpy(items, rep), "raw pyzmq": lambda: raw_zmq(raw_url, items, rep)}
            steps |= {"memory tier": lambda: store_put_get(MemoryTier(4 * total), items, rep),
                      "daemon shm": lambda: store_put_get(shm, items, rep),
                      "daemon tcp": lambda: store_put_get(tcp, items, rep),
                      "disk tier (page cache)": lambda: store_put_get(DiskTier(tmp.name, 4 * total), items, rep)}
            if args.redis_url:
                steps |= {"raw redis-py": lambda: raw_redis(args.redis_url, items, rep),
                          "redis tier": lambda: store_put_get(RedisTier(args.redis_url, prefix="bench:"), items, rep)}
            steps = _picked(steps, args.paths)
            figures = {}
            for i, (path, step) in enumerate(steps.items()):
                print(f"[{n + 1}/{len(sizes)} {label}] {i + 1}/{len(steps)} {path} ...", file=sys.stderr, flush=True)
                figures[path] = step()
            result["rows"] += [row(label, path, figures) for path in figures]
    finally:
        tcp.close(), shm.close()
        for proc in (daemon, raw_proc):
            proc.terminate()
            proc.wait()
        tmp.cleanup()
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="'' leaves the Redis rows out")
    p.add_argument("--total-mib", type=int, default=64, help="MiB moved per measurement")
    p.add_argument("--sizes", default="64KiB,1MiB,8MiB", help=f"object sizes, of {', '.join(SIZES)}")
    p.add_argument("--repeats", type=int, default=5, help="best of this many")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--unsealed", action="store_true",
                   help="move plain tensors rather than sealed objects (what nodes store): the daemon's TCP "
                        "transport then hashes every payload on both sides")
    p.add_argument("--paths", default="", help="comma-separated paths to run (their baselines run too), e.g. "
                   "'redis tier'; empty: every path")
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure here")


def run_command(args) -> int:
    torch.set_num_threads(1)
    bad = [s for s in args.sizes.split(",") if s not in SIZES]
    if bad or args.total_mib <= 0 or args.repeats <= 0:
        raise SystemExit(f"pdserve bench kvstore: sizes {bad} not in {list(SIZES)}, or --total-mib "
                         f"{args.total_mib} / --repeats {args.repeats} not > 0")
    result = run(args)
    print_table(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"result written to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench kvstore", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_command(p.parse_args(argv))


def _picked(steps: dict, paths: str) -> dict:
    """The steps of ``paths`` (comma-separated; all when empty) and of their baselines, in the table's order."""
    wanted = {p.strip() for p in paths.split(",") if p.strip()}
    if not wanted:
        return steps
    unknown = wanted - set(steps)
    if unknown:
        raise SystemExit(f"pdserve bench kvstore: --paths {sorted(unknown)} not in {list(steps)}")
    wanted |= {BASELINE[p] for p in wanted}
    return {path: step for path, step in steps.items() if path in wanted}


def _bytes(items) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)


if __name__ == "__main__":
    raise SystemExit(main())
