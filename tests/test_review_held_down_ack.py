"""Review of 1793ad0 (a Delete is answered once the store removed the lower tiers' copies): not when a tier is down.

Finding: 1793ad0 holds a Delete's reply until ``marker.done`` (kvstore/daemon.py ``_delete`` / ``_answer_held``) to
fix test_review_delq_ack ("an answered Delete is undone when the daemon dies"). But ``TieredStore._removed``
(kvstore/tiered.py, its ``finally``) sets ``marker.done`` also when a tier MISSED the removal -- the removal then
lives only in the worker's in-memory ``_retry`` -- and ``close()`` (the worker's "stop") drops whatever is still
in ``_retry`` without a word. So with Redis down (a restart, a failover) the daemon answers the Delete at once, as
before; the daemon stops (SIGTERM: a clean stop; or it dies) before Redis is back; Redis comes back with its data
and the deleted object is served again to every reader: the delq_ack outcome, for the case a Delete is most likely
to meet a problem in.

Minimal fix: let the reply say what happened: ``_Marker.ok = not missed`` and the daemon answers ``ok=False``
("pending: <tier> down") when a tier missed it -- or hold the reply until the retry is done (``_Retry`` keeps the
marker; the client's timeout covers a long outage, and a timed-out Delete is one the caller knows is unconfirmed).
At least log (WARNING) the removals ``close()`` abandons.

Fixed (stop 50), the first way: the reply says what happened (``RemovalPending``), the removal is kept and retried
(kvstore/removals.py), and ``close()`` logs what it abandons.
"""

from __future__ import annotations

import subprocess

import redis
import pytest
import torch

from kvstore_fixtures import TOKEN, DaemonProcess, free_port, unique_prefix, wait_for
from pdserve.kvstore.client import DaemonClient, RemovalPending


def _redis(port: int, data_dir) -> subprocess.Popen:
    """A redis-server that keeps its data across a restart (AOF), as a deployed one does."""
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
                             "--appendonly", "yes", "--save", ""], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_connect_timeout=0.2)

    def pings() -> bool:
        assert proc.poll() is None, "redis-server exited"
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
    wait_for(pings, what=f"redis-server on {port}")
    client.close()
    return proc


def test_a_delete_redis_missed_is_answered_pending_and_done_once_redis_is_back(tmp_path):
    """(Fixed, stop 50) The Delete is no longer answered as done while Redis was down for it: ``RemovalPending`` names
    the tier (the caller knows it is unconfirmed; were the daemon to stop now, Redis would keep the object). The daemon
    keeps the removal for Redis and does it once Redis is back, with its data (AOF)."""
    port, prefix = free_port(), unique_prefix() + ":"
    server = _redis(port, tmp_path)
    daemon = DaemonProcess("--kv-cpu-bytes", str(64 << 20), "--kv-redis", f"redis://127.0.0.1:{port}/0",
                           "--kv-redis-prefix", prefix, "--log-level", "ERROR", token=TOKEN)
    raw = redis.Redis(port=port)
    try:
        with DaemonClient(daemon.url, token=TOKEN, timeout_s=10) as client:
            client.put([("k:0", torch.ones(1024))])
            wait_for(lambda: raw.exists(prefix + "k:0") == 1, what="k:0 reaching Redis")
            server.kill()                            # Redis restarts (or fails over): connections refused
            server.wait(10)
            with pytest.raises(RemovalPending, match="redis"):
                client.delete(["k:0"])               # not "deleted": Redis missed it
            assert client.get(["k:0"]) == [None]     # gone from L1, and hidden from Redis's copy meanwhile
            assert client.stats()["writethrough"]["removals_pending"] == 1
            server = _redis(port, tmp_path)          # Redis is back, with its data
            wait_for(lambda: raw.exists(prefix + "k:0") == 0, what="the kept removal reaching Redis")
            wait_for(lambda: client.stats()["writethrough"]["removals_pending"] == 0, what="the removal settled")
            assert client.get(["k:0"]) == [None]
            client.delete(["k:0"])                   # with every tier up: answered as done
    finally:
        raw.close()
        daemon.stop()
        if server.poll() is None:
            server.kill()
            server.wait(10)
