"""A TCP put's part size, A/B in one run: the same objects put through one daemon in parts of each ``--parts`` MiB,
alternated with raw pyzmq, call by call (issue 40: daemon tcp >= 0.8 x raw pyzmq).

The daemon runs as ``pdserve bench kvstore`` runs it (``start_daemon``: own process, cluster token, arena L1); the
client switches ``client_segment.PART_BYTES`` between calls, so every variant sees the box's load as the others do.
Prints each variant's min and median ms and their ratios to raw pyzmq's. On a 2-vCPU VM a single call varies 2x:
use ``--calls`` 100 or more.

    python devbench/kvstore_tcp_parts.py --size-kib 1024 --parts 4,16,64 --calls 150
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-kib", type=int, default=1024)
    p.add_argument("--total-mib", type=int, default=64)
    p.add_argument("--parts", default="4,64", help="comma-separated part sizes in MiB")
    p.add_argument("--calls", type=int, default=100, help="alternations (each: raw pyzmq, then every variant)")
    args = p.parse_args()
    from pdserve.bench.kvstore_bench import raw_zmq, sealed_objects, start_daemon, start_raw_zmq
    from pdserve.engine import host_memory
    from pdserve.kvstore import client_segment
    from pdserve.kvstore.auth import new_token
    from pdserve.kvstore.client import DaemonClient

    host_memory.tune()
    torch.set_num_threads(1)
    size, total, token = args.size_kib << 10, args.total_mib << 20, new_token()
    parts = [int(x) << 20 for x in args.parts.split(",")]
    daemon, url = start_daemon(4 * total, token)
    raw_proc, raw_url = start_raw_zmq()
    client = DaemonClient(url, token=token)
    raw = raw_zmq(raw_url, sealed_objects(size, total, 0, "z-"))
    items = sealed_objects(size, total, 0, "t-")
    times: dict[int | str, list[float]] = {"raw pyzmq": [], **{part: [] for part in parts}}
    try:
        client.put(items)
        raw.put()
        for _ in range(args.calls):
            times["raw pyzmq"].append(_timed(raw.put))
            for part in parts:
                client_segment.PART_BYTES = part
                times[part].append(_timed(lambda: client.put(items)))
        got = client.get([k for k, _ in items])
        assert all(torch.equal(g, t) for g, (_, t) in zip(got, items)), "a round trip changed the bytes"
    finally:
        client.close()
        raw.close()
        for proc in (daemon, raw_proc):
            proc.terminate()
            proc.wait()
    base = times.pop("raw pyzmq")
    print(f"{args.size_kib} KiB objects, {args.total_mib} MiB a put, {args.calls} calls each")
    print(f"  raw pyzmq        min {min(base) * 1e3:6.1f} ms  median {statistics.median(base) * 1e3:6.1f} ms")
    for part, t in times.items():
        mid = statistics.median(t)
        print(f"  parts of {part >> 20:3d} MiB: min {min(t) * 1e3:6.1f} ms  median {mid * 1e3:6.1f} ms"
              f"  x raw: {min(base) / min(t):.2f} (min) {statistics.median(base) / mid:.2f} (median)")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
