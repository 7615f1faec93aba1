"""Where the daemon's TCP put/get time goes, per MiB, on each side (issue: daemon tcp >= 0.8 x raw pyzmq).

Runs a real daemon (token, signed requests, arena L1) in a child process with perf counters wrapped around its
stages (recv, request handling, digest, the copy into L1 -- or keeping the frames --, send), and a ``DaemonClient`` here with counters around
its digest and wait; then the same bytes through raw pyzmq. Prints microseconds per MiB per stage (best of
``--repeats`` whole runs for the totals; stage sums over all runs divided by the MiB moved).

    python devbench/kvstore_tcp_profile.py --size-kib 1024 --total-mib 64
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import threading
import time
from collections import defaultdict

import torch

T: dict[str, float] = defaultdict(float)


def timed(name: str, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[name] += time.perf_counter() - t0
    return wrapper


def _daemon(token: str, cpu_bytes: int, track_from: int | None, q) -> None:
    import zmq

    from pdserve.kvstore import daemon as D
    from pdserve.kvstore import daemon_arena
    from pdserve.kvstore import protocol as P
    from pdserve.engine import host_memory
    from pdserve.kvstore.config import KVStoreConfig, build_store

    host_memory.tune()                # as cli.run does for `pdserve kvstore` (and the raw pyzmq server for itself)
    torch.set_num_threads(1)
    if track_from is not None:
        D.TRACK_FROM = track_from
    if hasattr(P, "wire_digest"):                 # (an older build, for an A/B, digests through digest_of)
        P.wire_digest = timed("daemon digest", P.wire_digest)
    else:
        P.digest_of = timed("daemon digest", P.digest_of)
    P.check_digest = timed("daemon digest", P.check_digest)
    store = build_store(KVStoreConfig(cpu_bytes=cpu_bytes), arena=True)
    for name in ("store_bytes", "store_many", "keep_frames"):   # (newer builds: a batch; frames kept, not copied)
        if hasattr(store, name):
            setattr(store, name, timed("daemon copy into L1", getattr(store, name)))
    d = D.KVDaemon(store, port=0, token=token)
    d.handle = timed("daemon handle (all)", d.handle)
    sock = d._sock

    if hasattr(D, "recv_frames"):     # the serve loop's receive and send, timed
        D.recv_frames = timed("daemon recv", D.recv_frames)
    if hasattr(D, "send_frames"):
        D.send_frames = timed("daemon send", D.send_frames)

    class Sock:                       # (an older build: the socket's own multipart calls)
        def __getattr__(self, name):
            return getattr(sock, name)
        recv_multipart = staticmethod(timed("daemon recv", sock.recv_multipart))
        send_multipart = staticmethod(timed("daemon send", sock.send_multipart))
    d._sock = Sock()
    stop = threading.Event()
    q.put(d.endpoint)
    threading.Thread(target=d.serve, args=(stop,), daemon=True).start()
    while q.get() == "report":        # the stage times so far, then start again; anything else stops
        q.put(dict(T))
        T.clear()
    stop.set()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-kib", type=int, default=1024)
    p.add_argument("--total-mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--track-from", type=int, default=None, help="the daemon's TRACK_FROM (bytes), for an A/B")
    p.add_argument("--unsealed", action="store_true", help="plain tensors (digested) rather than sealed objects")
    p.add_argument("--copy-below", type=int, default=None,
                   help="the client's COPY_BELOW (bytes: put frames under it are copied into zmq), for an A/B")
    args = p.parse_args()
    import zmq

    from pdserve.bench.kvstore_bench import objects, sealed_objects, start_raw_zmq
    from pdserve.engine import host_memory
    from pdserve.kvstore import protocol as P
    from pdserve.kvstore.auth import new_token
    from pdserve.kvstore import client as client_module
    from pdserve.kvstore.client import DaemonClient

    host_memory.tune()                # as the bench and a node's engine do
    torch.set_num_threads(1)
    token, total = new_token(), args.total_mib << 20
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_daemon, args=(token, 4 * total, args.track_from, _Pair(q_in, q_out)))
    proc.start()
    url = q_out.get()
    items = (objects if args.unsealed else sealed_objects)(args.size_kib << 10, total, 0)
    keys = [k for k, _ in items]
    if hasattr(P, "wire_digest"):
        P.wire_digest = timed("client digest", P.wire_digest)
    else:
        P.digest_of = timed("client digest", P.digest_of)
    P.check_digest = timed("client digest", P.check_digest)
    if args.copy_below is not None:
        client_module.COPY_BELOW = args.copy_below
    client = DaemonClient(url, token=token)
    client._await = timed("client wait for reply", client._await)
    client.ping()
    best, stages, cpu = {}, {}, {}
    for op, fn in (("put", lambda: client.put(items)), ("get", lambda: client.get(keys))):
        q_in.put("report")
        q_out.get()
        T.clear()
        c0 = _cpu("self"), _cpu(proc.pid)
        best[op] = min(_timed_run(fn) for _ in range(args.repeats))
        cpu[op] = _cpu("self") - c0[0], _cpu(proc.pid) - c0[1]
        q_in.put("report")
        stages[op] = {**q_out.get(), **T}
    assert all(torch.equal(g, t) for g, (_, t) in zip(client.get(keys), items))
    client.close()
    q_in.put("stop")
    proc.join()
    raw_proc, raw_url = start_raw_zmq()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(raw_url)
    frames = [t.view(torch.uint8).numpy() for _, t in items]
    raw = {"put": lambda: (sock.send_multipart([b"put", *frames], copy=False), sock.recv_multipart(copy=False)),
           "get": lambda: (sock.send_multipart([b"get"]), sock.recv_multipart(copy=False))}
    raw_best, raw_cpu = {}, {}
    for op, fn in raw.items():
        c0 = _cpu("self"), _cpu(raw_proc.pid)
        raw_best[op] = min(_timed_run(fn) for _ in range(args.repeats))
        raw_cpu[op] = _cpu("self") - c0[0], _cpu(raw_proc.pid) - c0[1]
    sock.close(linger=0)
    rp, rg = total / raw_best["put"] / 1e9, total / raw_best["get"] / 1e9
    raw_proc.terminate()
    raw_proc.wait()
    mib = args.total_mib * args.repeats
    print(f"{args.size_kib} KiB objects, {args.total_mib} MiB x {args.repeats} runs")
    print(f"best: put {total / best['put'] / 1e9:.2f} GB/s ({best['put'] / args.total_mib * 1e6:.0f} us/MiB), "
          f"get {total / best['get'] / 1e9:.2f} GB/s ({best['get'] / args.total_mib * 1e6:.0f} us/MiB); "
          f"raw pyzmq put {rp:.2f} get {rg:.2f} GB/s -> x{total / best['put'] / 1e9 / rp:.2f} / "
          f"x{total / best['get'] / 1e9 / rg:.2f}")
    for op, times in stages.items():
        (cc, dc) = cpu[op]
        (rc, rs) = raw_cpu[op]
        print(f"  {op}: CPU (all threads) client {cc / mib * 1e6:.0f} + daemon {dc / mib * 1e6:.0f} us/MiB; raw pyzmq: "
              f"client {rc / mib * 1e6:.0f} + server {rs / mib * 1e6:.0f} us/MiB")
        for name, t in sorted(times.items()):
            print(f"    {name:<28} {t / mib * 1e6:8.0f} us/MiB")


def _cpu(pid) -> float:
    """CPU seconds (user + system, every thread) ``pid`` has used so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed_run(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class _Pair:
    """Two queues as one handle: the child reads ``a`` and writes ``b``."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def get(self):
        return self.a.get()

    def put(self, x):
        self.b.put(x)


if __name__ == "__main__":
    main()
