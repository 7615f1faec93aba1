"""Review of 17c5eba (deletes and discards behind the write-through queue): what a Delete's reply now means.

Finding: before 17c5eba the daemon answered Delete once every lower tier had removed the keys (behind the queued
writes). Now it answers at once (kvstore/daemon.py ``_delete`` -> ``delete_nowait``) and the removal waits in the
in-memory write-through queue. The daemon dies (OOM kill, crash, SIGKILL; or SIGTERM with a stalled Redis: ``close()``
gives the worker 30 s) before the worker got there: the answered Delete never happens, and every later reader -- the
restarted daemon, a proxy or node reading the same Redis -- is served the deleted object. The protocol has no op to
wait for it (no Flush), so no client can get the old guarantee back. Passes on 9ffc85f.

Minimal fix: keep the Delete's reply until the worker has done it without blocking the serve thread -- the ROUTER
socket may answer later: queue (ident, request id, marker) and send the reply from ``serve`` once ``marker.done`` is
set (as ``_sweep_sent`` does for trackers). Or, if the weaker reply is wanted, say so in protocol.Delete's docstring.
"""

from __future__ import annotations

import os
import signal

import redis
import torch

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures (own_redis)
from kvstore_fixtures import TOKEN, DaemonProcess, unique_prefix, wait_for
from pdserve.kvstore.client import DaemonClient


def test_an_answered_delete_is_not_undone_by_the_daemon_dying(own_redis):
    prefix = unique_prefix() + ":"
    daemon = DaemonProcess("--kv-cpu-bytes", str(512 << 20), "--kv-redis", own_redis.url, "--kv-redis-prefix", prefix,
                           "--log-level", "ERROR", token=TOKEN)
    raw = redis.Redis(port=own_redis.port)
    try:
        with DaemonClient(daemon.url, token=TOKEN, timeout_s=30) as client:
            client.put([("k:0", torch.ones(1024))])
            wait_for(lambda: raw.exists(prefix + "k:0") == 1, what="k:0 reaching Redis")
            client.put([(f"bulk{i}:0", torch.full((1 << 19,), float(i))) for i in range(64)])   # 128 MiB queued
            # (the 128 MiB usually still queued here: the Delete's removal waits behind it)
            client.delete(["k:0"])                   # answered: k:0 is deleted
            assert client.get(["k:0"]) == [None]
        os.kill(daemon.proc.pid, signal.SIGKILL)     # the daemon dies after answering
        daemon.proc.wait(10)
        assert raw.exists(prefix + "k:0") == 0, "an answered Delete was undone: Redis still serves k:0"
    finally:
        raw.close()
        daemon.stop()
