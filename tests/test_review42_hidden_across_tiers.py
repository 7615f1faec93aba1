"""Review of 56ed6d4 (kept removals): a removal kept for ONE down tier hides the key in EVERY lower tier.

Finding (new in 56ed6d4): a removal that Redis misses while down is kept for Redis, and the key is counted in
``_deleting`` -- which ``_fill_from_lower`` and ``contains`` apply to all lower tiers alike. The disk tier did the
removal, and a later put of the key reaches disk (``_write_batch`` settles only the removals kept for the tiers it
reached: disk has none); yet that newer object on disk stays invisible -- gets miss, ``contains`` says no -- until
Redis is back and the retry ran. The stale copy can only be in Redis; only Redis's reads need hiding. With Redis
down for long (the outage case this commit is about; "a dead Redis costs hits, never a failed call"), every key
deleted once during the outage loses its disk hits for the rest of the outage, newer objects included: a decode node
recomputes what the disk tier holds. Before 56ed6d4 the key was unhidden once the worker had run the removal.

Fix: hide a kept removal's key from the tier it was kept for only (a per-tier hidden set, under ``_lock``), keeping
``_deleting`` (all tiers) for the queued removals.
"""

from __future__ import annotations

import torch

from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore
from test_kvstore_writethrough import FakeTier


class Outage(FakeTier):
    """Every call raises while ``fail`` is set (a Redis that refuses connections)."""

    def get(self, keys):
        if self.fail:
            raise ConnectionError("refused")
        return super().get(keys)

    def contains(self, keys):
        if self.fail:
            raise ConnectionError("refused")
        return super().contains(keys)

    def delete(self, keys):
        if self.fail:
            raise ConnectionError("refused")
        super().delete(keys)


def test_a_newer_object_on_disk_is_served_while_redis_still_owes_a_removal():
    redis, disk = Outage("redis"), FakeTier("disk")
    store = TieredStore(MemoryTier(64), [redis, disk], backoff_base_s=1.0, backoff_max_s=1.0)
    store.health["redis"] = TierHealth("redis", 1.0, 1.0, clock=lambda: 0.0)   # down for the whole test
    old, new = torch.ones(8), torch.full((8,), 2.0)
    try:
        store.put([("k", old)])
        assert store.flush()
        redis.fail = True
        done = store.delete_nowait(["k"])
        assert done.wait(10) and done.missed == ("redis",)
        assert "k" not in disk.data and store.stats()["writethrough"]["removals_pending"] == 1
        store.put([("k", new)])                               # the newer object: disk has it, Redis skipped (down)
        assert not store.flush() and torch.equal(disk.data["k"], new)
        store.put([("filler", torch.zeros(16))])              # L1 (64 bytes) evicts k
        assert store.flush() is False and store.l1.contains(["k"]) == [False]
        assert store.contains(["k"]) == [True], "disk holds k's newer object, yet the store says it has none"
        got = store.get(["k"])[0]
        assert got is not None and torch.equal(got, new), "disk's newer object is hidden while Redis is down"
    finally:
        store.close()
