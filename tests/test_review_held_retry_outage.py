"""Review of 1793ad0 (held Delete replies; removals a down tier missed are retried): the retry gives up on an outage.

Finding: ``TieredStore._retry_removals`` (kvstore/tiered.py, ``retry.fails += result is _FAILED``) counts every
``_FAILED`` as a refusal, but ``_call`` returns ``_FAILED`` for the probe of a tier that is DOWN and still unreachable
too (``health.failed``: a timeout, connection refused). So after ``RETRY_FAILS`` (3) probes of a Redis that is still
down -- ~3.5 s of outage with the default back-off (0.5, 1, 2 s), less with a shorter one -- the removal is dropped,
the key is uncounted (visible again) and, when Redis comes back, the deleted object is served again: the very
outcome the retry exists to prevent (tests/test_review_delq_down_tier.py covers only an outage shorter than 3 probes).
The docstring says "given up after RETRY_FAILS failures of a tier that was up (it refuses)"; the code does not check
that the tier was up.

Minimal fix: count a failure only when the tier is still up after it (a refusal: ``_call``'s ValueError path, which
calls ``health.release()`` rather than ``health.failed``), e.g.
``retry.fails += result is _FAILED and not self.health[tier.name].down`` -- or have ``_call`` return a distinct
``_REFUSED`` for the ValueError path.
"""

from __future__ import annotations

import subprocess
import time

import redis
import torch

from kvstore_fixtures import free_port, unique_prefix, wait_for
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.redis_tier import RedisTier
from pdserve.kvstore.tiered import RETRY_FAILS, TieredStore


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


def test_a_delete_retried_through_an_outage_is_not_given_up(tmp_path):
    port = free_port()
    server = _redis(port, tmp_path)
    store = TieredStore(MemoryTier(1 << 20), [RedisTier(f"redis://127.0.0.1:{port}/0", unique_prefix() + ":",
                                                        timeout_s=0.2)], backoff_base_s=0.05, backoff_max_s=0.05)
    try:
        store.put([("k", torch.ones(256))])
        assert store.flush()
        server.kill()                                        # an outage (a restart): connections refused
        server.wait(10)
        store.delete(["k"])                                  # refused: kept for retry, k hidden meanwhile
        assert store.get(["k"]) == [None]
        health, deadline = store.health["redis"], time.monotonic() + 10

        def probed() -> bool:                                # the worker's retries probe the down tier (RETRY_S)
            assert time.monotonic() < deadline
            return health.failures >= RETRY_FAILS + 1
        wait_for(probed, what="the worker probing the dead Redis")
        time.sleep(0.2)
        server = _redis(port, tmp_path)                      # Redis is back, with its data
        deadline = time.monotonic() + 5

        def back() -> bool:
            assert time.monotonic() < deadline and server.poll() is None
            store.put([("probe", torch.ones(256))])
            return store.flush() and store.stats()["redis"]["down"] == 0
        wait_for(back, what="redis back up")
        assert store.flush()
        assert store.get(["k"]) == [None], \
            "the delete was given up during the outage: the deleted object is served again once Redis is back"
    finally:
        store.close()
        if server.poll() is None:
            server.kill()
            server.wait(10)
