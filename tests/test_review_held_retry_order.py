"""Review of 1793ad0 (removals a down tier missed are retried): a retried delete removes a put made after it.

Finding (new in 1793ad0; a write-through ordering violation): ``_write_loop`` runs ``_retry_removals`` before each
queued op, but a retry whose tier is still backing off is skipped (``_call`` -> ``_DOWN``) while the op right behind
it may find the tier available: the back-off expires in between (during the put to an earlier tier, or a reader's
get on another thread is the probe that brings the tier back up). Then a put of the same key -- queued AFTER the delete
-- is written to that tier, ``flush()`` says it reached every tier, and the worker's next retry deletes it.
The "none lands after" guarantee of a delete (tiered.py's header) is broken the other way round: the older delete
lands after the newer put. A durable writer (the prefill publisher: ``adopt`` + ``flush``) is told its chunk is in
Redis while it is gone; a decode node reading Redis misses it. (Content-addressed keys make the bytes the same, so
this is a lost object, not wrong bytes -- but the lost put is exactly the one ``flush()`` vouched for.)
Before 1793ad0 the skipped delete was simply forgotten (test_review_delq_down_tier), so the put survived.

Minimal fix: a retry pending for (tier, key) must be resolved before a later write of that key reaches that tier --
e.g. ``_write_batch`` skips (counts as lost) the tiers a pending retry of one of its keys still waits for, or drops
those keys from the retry when the put reaches the tier (the newer write supersedes the older delete: remove the
key from ``retry.keys``/``arg`` for that tier and ``_uncount`` it once no tier is left).
"""

from __future__ import annotations

import torch

from test_kvstore_writethrough import FakeTier
from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore


class FlakyTier(FakeTier):
    """A FakeTier whose deletes also raise while ``fail`` is set (a Redis that refuses connections)."""

    def delete(self, keys):
        if self.fail:
            raise ConnectionError(f"{self.name}: connection refused")
        super().delete(keys)


def test_a_retried_delete_does_not_remove_a_later_put_of_the_key():
    first, flaky = FakeTier("first"), FlakyTier("flaky")
    store = TieredStore(MemoryTier(1 << 20), [first, flaky], backoff_base_s=1.0, backoff_max_s=1.0)
    now = [0.0]
    store.health["flaky"] = TierHealth("flaky", 1.0, 1.0, clock=lambda: now[0])
    try:
        store.put([("k", torch.ones(250))])
        assert store.flush() and "k" in flaky.data
        flaky.fail = True
        store.delete(["k"])                       # flaky refuses: marked down, the removal kept for retry
        assert "k" not in first.data and "k" in flaky.data
        flaky.fail = False                        # it is back, but backing off until now=1.0

        first.gate.clear()
        first.entered.clear()
        store.put([("k", torch.full((250,), 2.0))])   # the same key again, queued after the delete
        assert first.entered.wait(10), "the worker never reached the put"
        # the worker ran its retries before this put: flaky was backing off, the retry skipped
        now[0] = 5.0                              # the back-off expires while the put is on the first tier
        first.gate.set()
        assert store.flush(), "the put reached every tier"
        assert store.stats()["flaky"]["wt_written"] == 2     # k (old), then k (new) written to flaky
        assert store.flush()                      # (one more op: the worker's retries run again)
        assert "k" in flaky.data, "the older delete, retried, removed the newer put flush() vouched for"
    finally:
        first.gate.set()
        store.close()
