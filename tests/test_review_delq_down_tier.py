"""Review of 17c5eba (deletes and discards behind the write-through queue): a lower tier down when the delete runs.

Finding -- PRE-EXISTING, not new in 17c5eba (fails on 9ffc85f the same way): a delete that reaches a lower tier while
that tier is marked down (``TierHealth``; e.g. by the write queued just ahead of it timing out on a stalled Redis) is
skipped (``_call`` -> ``_DOWN``) and forgotten. 17c5eba then uncounts the key (``_removed``'s ``finally``), so reads go
to that tier again, and once it is back the deleted object is served again -- to this store and to every other. The
new queue makes the fix cheap: a skipped/failed delete could be kept (per tier) and retried by the worker when the tier
comes back up, the key staying masked meanwhile.
Fixed (stop 50): kvstore/removals.py keeps it per tier; the worker retries it once the tier takes calls again.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures (own_redis)
from kvstore_fixtures import unique_prefix, wait_for
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.redis_tier import RedisTier
from pdserve.kvstore.tiered import TieredStore


def test_a_deleted_object_does_not_come_back_with_its_tier(own_redis):
    prefix = unique_prefix() + ":"
    store = TieredStore(MemoryTier(1 << 20), [RedisTier(own_redis.url, prefix, timeout_s=0.3)],
                        backoff_base_s=0.05, backoff_max_s=0.05)
    redis = own_redis.client()
    try:
        store.put([("k", torch.ones(256))])
        assert store.flush()
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        try:
            store.put([("stuck", torch.ones(256))])  # times out on the stopped server: redis marked down
            store.delete(["k"])                      # behind it: skipped (down) or a probe that times out too
            assert store.get(["k"]) == [None]
            assert store.stats()["writethrough"]["removals_pending"] == 1     # kept for redis
        finally:
            os.kill(own_redis.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5

        def back() -> bool:
            assert time.monotonic() < deadline and own_redis.proc.poll() is None
            store.put([("probe", torch.ones(256))])
            return store.flush() and store.stats()["redis"]["down"] == 0
        wait_for(back, what="redis back up")
        assert store.get(["k"]) == [None], "the deleted object is served again once its tier is back"
        wait_for(lambda: store.stats()["writethrough"]["removals_pending"] == 0, what="the kept removal retried")
        assert not redis.exists(prefix + "k"), "Redis still holds the deleted object"
        assert store.get(["k"]) == [None] and store.get(["probe"])[0] is not None
    finally:
        redis.close()
        store.close()
