"""Review of 1793ad0 (removals a down tier missed are retried): the worker's cost grows with the square of them.

Finding: every removal a down tier missed becomes one ``_Retry`` (kvstore/tiered.py ``_removed``), and the worker
walks the whole list before EACH later queued op (``_write_loop``: ``_retry_removals``, one ``_call`` ->
``health.available()`` under its lock per entry and tier, even while the tier is known down), and ``_trim_retries``
sums every entry's keys on each append. n single-key Deletes/Discards during an outage cost O(n^2): on this box 2,000
took the worker 1.2 s, 4,000 more 12 s, 8,000 more 52 s (MAX_RETRY_KEYS allows 65,536). Meanwhile everything queued
behind them waits: every put's write-through (the queue fills, writes are dropped), every flush(), and every held
Delete/Discard reply, so clients time out (the engine's DaemonClient: 2 s) -- for as long as the outage lasts and
beyond.

Minimal fix: keep the pending removals per tier (a set of keys to delete, a list of discards) with a running key
count; before an op, skip a tier at once while ``not health.available()`` (one check per tier, not per entry), and
retry a tier's deletes as one batched ``tier.delete(keys)``.
"""

from __future__ import annotations


import torch

from test_kvstore_writethrough import FakeTier
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore, _Marker


class DownTier(FakeTier):
    """A tier whose deletes are refused (the connection is): it is marked down and stays down."""

    def delete(self, keys):
        raise ConnectionError(f"{self.name}: connection refused")


def test_removals_pending_on_a_down_tier_do_not_stall_the_worker():
    store = TieredStore(MemoryTier(1 << 20), [DownTier("redis")], backoff_base_s=100.0, backoff_max_s=100.0)
    try:
        done = [store.delete_nowait([f"k{i}"]) for i in range(4000)][-1]   # e.g. a loader's discards, one by one
        assert done.wait(30.0), \
            "4000 single-key deletes with a tier down kept the worker busy over 30 s (and all queued behind them)"
        store.put([("x", torch.ones(10))])
        # a flush reports False (the tier is down); what counts is that the worker gets to it
        assert store._wait_queued(("flush", _Marker()), 30.0), "the worker never reached what was queued behind them"
    finally:
        store.close()
