"""Review 44: a removal of zero keys slips past the queued-removals bound (``tiered.MAX_QUEUED_REMOVALS``).

``_reserve_removals(0)`` never refuses (``n == 0`` never passes the bound), and ``_remove([])`` still queues a
"remove" op with its own ``Removal`` behind the stalled tier. Through the daemon each such Delete is held
(``KVDaemon._held``) until the worker reaches it. So while a tier stalls, a client's flood of empty Deletes grows
the write-through queue and the daemon's held replies without bound -- what the bound was added to stop -- and a
no-op Delete is not answered until the stalled tier moves (it times out at the client).
"""

from __future__ import annotations

import contextlib

import pytest

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures
from kvstore_fixtures import TOKEN, serving
from pdserve.kvstore import protocol as P
from pdserve.kvstore import tiered
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.daemon import KVDaemon
from test_kvstore_writethrough import KB, FakeTier, _put, store_of  # noqa: F401 - the gated tier and its fixture
from test_kvstore_removal_bound import opened


def test_empty_deletes_do_not_queue_past_the_bound_behind_a_stalled_tier(store_of, monkeypatch):
    monkeypatch.setattr(tiered, "MAX_QUEUED_REMOVALS", 4)
    l2 = FakeTier("l2")
    store = store_of(l2)
    with opened(l2):
        _put(store, *[f"k{i}" for i in range(4)])
        assert store.flush()
        l2.gate.clear()
        _put(store, "stuck")
        assert l2.entered.wait(10)
        store.delete_nowait([f"k{i}" for i in range(4)])      # the bound is reached
        with pytest.raises(tiered.RemovalQueueFull):
            store.delete_nowait(["k0"])
        before = store._queue.qsize()
        for _ in range(10_000):
            store.delete_nowait([])                           # nothing to remove: must cost no queue entry
        grown = store._queue.qsize() - before
        assert grown == 0, f"{grown} empty removals queued behind the stalled tier past the bound of 4 keys"


def test_the_daemon_answers_an_empty_delete_at_once_while_a_tier_stalls(store_of, monkeypatch):
    monkeypatch.setattr(tiered, "MAX_QUEUED_REMOVALS", 4)
    l2 = FakeTier("l2")
    with serving(KVDaemon(store_of(l2), port=0, token=TOKEN)) as daemon, opened(l2), \
            contextlib.closing(DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=2)) as client:
        client.put([("k:0", KB)])
        assert daemon.store.flush()
        l2.gate.clear()
        client.put([("stuck:0", KB)])
        assert l2.entered.wait(10)
        held = []
        for _ in range(3):
            try:
                client._request(P.Delete(keys=[]))            # a Delete of no keys: a no-op
            except TimeoutError:
                held.append(len(daemon._held))
        assert not held, f"empty Deletes held behind the stalled tier (daemon._held grew to {held})"
