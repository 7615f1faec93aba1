"""``pdserve bench kvstore``: the KV store's data plane against raw baselines measured in the same run.

Who calls it: ``bench/cli.py`` (``pdserve bench kvstore``); ``python -m pdserve.bench.kvstore_bench`` runs
the same. Each row moves ``--total-mib`` of objects of one size (64 KiB, 1 MiB, 8 MiB; fixed ``--seed``) in
one batched call, ``--repeats`` rounds, and is divided by its baseline from this run: best by best, and the median
over rounds of the path's ratio to its baseline in that round (paired: on a box whose speed swings 2x from one call
to the next, each side's best can come from a moment of different load). A round times every path's put, then every
path's get, one call each, so a burst of load on the box lands on a path and its baseline alike (``measure``); each path moves objects of its own keys (``PREFIXES``). The objects are
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
from dataclasses import dataclass
from typing import Callable

import torch
import zmq

from pdserve.bench.kvstore_table import BASELINE, SIZES, hardware, print_table, row

PREFIXES = {"memcpy": "c-", "raw pyzmq": "z-", "memory tier": "m-", "daemon shm": "s-", "daemon tcp": "t-",
            "disk tier (page cache)": "d-", "raw redis-py": "r-", "redis tier": "R-"}

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


def objects(size: int, total: int, seed: int, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, total // size)
    return [(f"{prefix}bench{size}-{seed}-{i}:0", torch.randn(size // 2, generator=g).to(torch.bfloat16))
            for i in range(n)]


def sealed_objects(size: int, total: int, seed: int, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """``objects`` as the store holds them in a cluster: each sealed for its key (kvstore/seal.py, a random seal
    key), ``size`` bytes in all (seal header included). The transport skips its digest for these (protocol.py)."""
    from pdserve.kvstore.auth import ClusterKey
    from pdserve.kvstore.seal import SEAL_BYTES, seal

    key = ClusterKey.random().seal_key
    return [(k, seal(k, t[:(size - SEAL_BYTES) // 2], key)[0]) for k, t in objects(size, total, seed, prefix)]


@dataclass
class Step:
    """One path's put and get, each timed once per round (``measure``); ``check`` runs after the first put,
    ``close`` at the end."""
    put: Callable[[], object]
    get: Callable[[], object]
    check: Callable[[], None] = lambda: None
    close: Callable[[], None] = lambda: None


def measure(steps: dict[str, Step], repeats: int, label: str) -> dict[str, tuple[list[float], list[float]]]:
    """Each path's put and get seconds, one per round; a round times every path's put, then every path's get, so a
    burst of load on the box lands on a path and its baseline alike (not on whichever ran during it, as when a
    path's repeats all ran before the next path's) -- and round r of a path pairs with round r of its baseline."""
    times = {path: ([], []) for path in steps}
    for r in range(repeats):
        print(f"[{label}] round {r + 1}/{repeats}", file=sys.stderr, flush=True)
        for op in (0, 1):
            for path, step in steps.items():
                fn = step.put if op == 0 else step.get
                t0 = time.perf_counter()
                fn()
                times[path][op].append(time.perf_counter() - t0)
                if r == 0 and op == 0:
                    step.check()
    return times


def memcpy(items) -> Step:
    dst = [torch.empty_like(t) for _, t in items]

    def copy():
        for d, (_, t) in zip(dst, items):
            d.copy_(t)
    return Step(copy, copy)


def store_step(store, items) -> Step:
    keys = [k for k, _ in items]

    def check():
        got = store.get(keys)
        if not all(g is not None and torch.equal(g, t) for g, (_, t) in zip(got, items)):
            raise RuntimeError(f"{type(store).__name__}: a round trip did not return the bytes put")
    return Step(lambda: store.put(items), lambda: store.get(keys), check, lambda: store.delete(keys))


def raw_redis(url: str, items) -> Step:
    import redis

    client = redis.Redis.from_url(url)
    blobs = [("rawbench:" + k, t.view(torch.uint8).numpy().tobytes()) for k, t in items]

    def put():
        pipe = client.pipeline(transaction=False)
        for k, b in blobs:
            pipe.set(k, b)
        pipe.execute()

    def close():
        client.delete(*[k for k, _ in blobs])
        client.close()
    return Step(put, lambda: client.mget([k for k, _ in blobs]), close=close)


def raw_zmq(url: str, items) -> Step:
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
    return Step(put, get, close=sock.close)


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
            make = objects if args.unsealed else sealed_objects
            items = _Items(lambda path: make(size, total, args.seed, PREFIXES[path]))
            steps = {"memcpy": lambda: memcpy(items["memcpy"]),
                     "raw pyzmq": lambda: raw_zmq(raw_url, items["raw pyzmq"]),
                     "memory tier": lambda: store_step(MemoryTier(4 * total), items["memory tier"]),
                     "daemon shm": lambda: store_step(shm, items["daemon shm"]),
                     "daemon tcp": lambda: store_step(tcp, items["daemon tcp"]),
                     "disk tier (page cache)": lambda: store_step(DiskTier(tmp.name, 4 * total),
                                                                  items["disk tier (page cache)"])}
            if args.redis_url:
                steps |= {"raw redis-py": lambda: raw_redis(args.redis_url, items["raw redis-py"]),
                          "redis tier": lambda: store_step(RedisTier(args.redis_url, prefix="bench:"),
                                                           items["redis tier"])}
            built = {path: make_step() for path, make_step in _picked(steps, args.paths).items()}
            try:
                times = measure(built, rep, f"{n + 1}/{len(sizes)} {label}")
            finally:
                for step in built.values():
                    step.close()
            result["rows"] += [row(label, path, times, total_of(items[path])) for path in times]
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
    p.add_argument("--repeats", type=int, default=9, help="rounds (each times every path once): the best of them, "
                   "and the median of each round's ratio to its baseline")
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


class _Items(dict):
    """Each path's objects, made on first use: the same sizes and bytes, keys of their own (``PREFIXES``), so no
    two paths read each other's objects from a shared daemon or Redis."""
    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, path: str):
        self[path] = self.make(path)
        return self[path]


def total_of(items) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)


if __name__ == "__main__":
    raise SystemExit(main())
