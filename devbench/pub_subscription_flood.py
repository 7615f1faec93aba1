"""What made-up subscriptions from a peer without the token cost a plain ZMQ PUB (the KV-event socket before CURVE).

A PUB binds 127.0.0.1 in this process; a child process connects an XSUB and sends ``--subscriptions`` distinct
200-byte subscriptions; then the PUB sends once (it takes in pending subscriptions when its owner uses it). Printed:
this process's peak RSS growth and the seconds it took. With ``--curve`` the PUB is a CURVE server with a cluster
key (``kv_curve``) and the child, without the token, is refused at the handshake.

    python devbench/pub_subscription_flood.py --subscriptions 1000000
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import zmq

from pdserve.engine.kv import kv_curve

CHILD = r"""
import os, sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.XSUB)
sock.setsockopt(zmq.LINGER, 60000)
sock.setsockopt(zmq.SNDHWM, 0)
sock.connect(sys.argv[1])
for _ in range(int(sys.argv[2])):
    sock.send(b"\x01" + os.urandom(200))
sock.close()
ctx.term()
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--subscriptions", type=int, default=1_000_000)
    p.add_argument("--curve", action="store_true")
    args = p.parse_args()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    kv_curve.serve(pub, kv_curve.server_keys("sub-flood-bench-token-0123456789") if args.curve else None)
    pub.bind("tcp://127.0.0.1:*")
    rss0, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    subprocess.run([sys.executable, "-c", CHILD, pub.getsockopt_string(zmq.LAST_ENDPOINT), str(args.subscriptions)],
                   check=True, timeout=1800)
    time.sleep(1.0)                                   # the last ones through the I/O thread
    pub.send(b"x")
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"subscriptions": args.subscriptions, "curve": args.curve,
                      "peak_rss_growth_mb": (rss1 - rss0) / 1024, "seconds": time.perf_counter() - start}))
    pub.close()
    ctx.term()


if __name__ == "__main__":
    main()
