"""What one message of many empty frames from a peer without the token costs a node's KV replay socket.

A publisher (the node's side: ``KVEventPublisher``, its replay ROUTER) runs in this process; a flooding peer in a
child process connects to the replay port without the token (a plain ZMQ socket), says whether its handshake
succeeded, and sends one message of ``--frames`` empty frames. Then a token holder sends a signed replay request
(as the proxy does: a CURVE client where the checkout has ``kv_curve``) and we time its answer. Printed: the
answer's latency after the flood vs without one (same run, the ratio), the replay thread's counters where the
checkout has them, and this process's peak RSS growth. Runs against any checkout (before and after CURVE):

    python devbench/replay_flood.py --frames 2000000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import zmq

from pdserve.engine.kv.kv_events import KVEventPublisher, events_key
from pdserve.engine.kv.kv_replay import replay_key, request_frames

try:
    from pdserve.engine.kv import kv_curve
except ImportError:                                   # a checkout before CURVE
    kv_curve = None

TOKEN = "flood-bench-cluster-token-0123456789"
FLOODER = r"""
import sys, zmq
from zmq.utils.monitor import recv_monitor_message
endpoint, frames = sys.argv[1], int(sys.argv[2])
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 30000)
monitor = sock.get_monitor_socket()
sock.connect(endpoint)
verdict = "none"
while verdict == "none" and monitor.poll(3000):
    event = recv_monitor_message(monitor)["event"]
    verdict = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "succeeded", zmq.EVENT_DISCONNECTED: "refused",
               zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "refused", zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "refused",
               zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused"}.get(event, "none")
print(verdict, flush=True)
try:
    sock.send_multipart([b""] * frames, flags=zmq.NOBLOCK)
except zmq.Again:
    pass
monitor.close()
sock.close()
ctx.term()
"""


def signed_answer_s(endpoint: str, timeout_s: float) -> float | None:
    """Seconds until a signed request sent now is answered (None: not within ``timeout_s``)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if kv_curve is not None:
        kv_curve.connect_to(sock, kv_curve.server_keys(TOKEN))
    sock.connect(endpoint)
    start = time.perf_counter()
    try:
        sock.send_multipart(request_frames(replay_key(events_key(TOKEN)), os.urandom(16)))
        return time.perf_counter() - start if sock.poll(int(timeout_s * 1000)) else None
    finally:
        sock.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=2_000_000)
    p.add_argument("--timeout-s", type=float, default=120.0)
    args = p.parse_args()
    pub = KVEventPublisher(TOKEN)
    try:
        baseline = signed_answer_s(pub.replay_endpoint, args.timeout_s)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        verdict = subprocess.run([sys.executable, "-c", FLOODER, pub.replay_endpoint, str(args.frames)],
                                 capture_output=True, text=True, check=True).stdout.strip()
        time.sleep(0.6)                               # past the node's 8 replies a second
        after = signed_answer_s(pub.replay_endpoint, args.timeout_s)
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        counts = pub._replay.counts if hasattr(pub._replay, "counts") else "n/a (checkout before CURVE)"
    finally:
        pub.close()
    print(json.dumps({"frames": args.frames, "flooder_handshake": verdict, "answer_s_no_flood": baseline,
                      "answer_s_after_flood": after, "ratio": after / baseline if after and baseline else None,
                      "peak_rss_growth_mb": (rss1 - rss0) / 1024, "replay_thread_counts": counts,
                      "curve": kv_curve is not None, "zmq": zmq.zmq_version()}, indent=1))


if __name__ == "__main__":
    main()
