"""What CURVE costs the KV-event PUB: batches a second, node to proxy, plain vs CURVE, in the same run.

One PUB (the node's side, ``kv_curve.serve``) and one SUB (the proxy's, ``kv_curve.connect_to``) over 127.0.0.1 TCP;
``--batches`` messages of ``--events`` public hashes each (msgpack, as ``encode_batch`` sends them; 8192 is
``MAX_EVENTS_PER_BATCH``, ~74 KB). Printed: seconds and MB/s per mode, and CURVE's time over plain's.

    python devbench/events_curve_cost.py --events 8192 --batches 2000
"""

from __future__ import annotations

import argparse
import json
import random
import time

import zmq

from pdserve.engine.kv import kv_curve
from pdserve.engine.kv.kv_events import EventBatch, encode_batch, events_key

TOKEN = "curve-cost-bench-cluster-token-0123456789"


def run(keys, frames: list[bytes], batches: int) -> float:
    """Seconds to send ``batches`` copies of ``frames`` from a PUB and receive them on a SUB."""
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    for sock in (pub, sub):
        sock.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)
    kv_curve.serve(pub, keys)
    pub.bind("tcp://127.0.0.1:*")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    kv_curve.connect_to(sub, keys)
    sub.connect(pub.getsockopt_string(zmq.LAST_ENDPOINT))
    while not sub.poll(10):                           # connected: nothing sent after this is lost
        pub.send_multipart(frames)
    while sub.poll(100):
        sub.recv_multipart()
    start = time.perf_counter()
    for _ in range(batches):
        pub.send_multipart(frames)
    for _ in range(batches):
        sub.recv_multipart()
    elapsed = time.perf_counter() - start
    pub.close()
    sub.close()
    ctx.term()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=8192)
    p.add_argument("--batches", type=int, default=2000)
    args = p.parse_args()
    rng = random.Random(0)
    batch = EventBatch("e" * 32, 1.0, 1, stored=[rng.getrandbits(63) for _ in range(args.events)])
    frames = encode_batch(events_key(TOKEN), batch)
    size = sum(len(f) for f in frames)
    plain = run(None, frames, args.batches)
    curve = run(kv_curve.server_keys(TOKEN), frames, args.batches)
    mb = size * args.batches / 1e6
    print(json.dumps({"batch_bytes": size, "batches": args.batches, "plain_s": plain, "curve_s": curve,
                      "plain_MB_s": mb / plain, "curve_MB_s": mb / curve, "curve_over_plain": curve / plain,
                      "zmq": zmq.zmq_version()}, indent=1))


if __name__ == "__main__":
    main()
