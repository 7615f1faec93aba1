"""Review 43: a Discard the daemon refused with RemovalQueueFull made ``DaemonClient.discard`` fall back to a Delete.

``DaemonClient.discard`` treated *any* DaemonError from a Discard as "a daemon without Discard" and sent
``Delete([key])`` (now the refusal has its own code, ``P.QUEUE_FULL`` -> ``RemovalRefused``, and is raised). Since the removal bound, a current daemon answers a Discard with an error (RemovalQueueFull) when
the queue is full. If the queue drains between that refusal and the fallback (the worker keeps draining while the
reply travels), the fallback Delete is taken and removes *every* tier's copy of the key -- including the intact copy a
lower tier holds, which a Discard (only the refused bytes' copies) keeps: the decode loader's ``_discard`` of a
sealed object that failed in L1 then costs the good copy in Redis/disk as well. The refusal should reach the caller
(or be retried as a Discard), never be turned into a Delete.

The interleaving is forced deterministically: a TieredStore whose refused discard lets the stuck tier go and waits for
the queue to drain before the refusal is answered.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures
from kvstore_fixtures import TOKEN, serving, wait_for
from pdserve.kvstore import tiered
from pdserve.kvstore.client import DaemonClient, RemovalRefused
from pdserve.kvstore.daemon import KVDaemon
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import RemovalQueueFull, TieredStore
from test_kvstore_removal_bound import opened
from test_kvstore_writethrough import KB, FakeTier


class _DrainsRightAfterARefusal(TieredStore):
    """The write-through worker catches up just after a refused discard (before the client's next request)."""

    def discards_nowait(self, refusals):            # (what the daemon's Discard calls)
        try:
            return super().discards_nowait(refusals)
        except RemovalQueueFull:
            for t in self.lower:
                t.gate.set()
            wait_for(lambda: self.stats()["writethrough"]["removals_queued"] == 0, what="the queue draining")
            raise


def test_a_refused_discard_never_becomes_a_delete_of_the_intact_copies(monkeypatch):
    monkeypatch.setattr(tiered, "MAX_QUEUED_REMOVALS", 1)
    l2 = FakeTier("l2")
    store = _DrainsRightAfterARefusal(MemoryTier(1 << 20), [l2], 256 << 20, 100.0, 100.0)
    good, bad = KB + 1, KB + 2
    with serving(KVDaemon(store, port=0, token=TOKEN)) as daemon, opened(l2), \
            contextlib.closing(DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=30)) as client:
        client.put([("k:0", good), ("other:0", KB + 3)])
        assert store.flush() and torch.equal(l2.data["k:0"], good)
        store.l1.adopt([("k:0", bad.clone())])             # L1's copy went bad; l2 keeps the intact one
        l2.gate.clear()
        store.put([("stuck:0", KB)])                       # the worker holds this write: removals queue behind it
        assert l2.entered.wait(10)
        store.delete_nowait(["other:0"])                   # the bound (1 key) is reached
        with pytest.raises(RemovalRefused, match="RemovalQueueFull"):
            client.discard("k:0", bad)                     # refused: the caller hears it (no Delete instead)
        assert store.flush()
        assert "k:0" in l2.data, ("the refused Discard was turned into a Delete by DaemonClient.discard: the intact "
                                  "copy in l2 is gone")
