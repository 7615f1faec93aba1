"""Queued removals are bounded (kvstore/tiered.py ``MAX_QUEUED_REMOVALS``; an open point of issue 40's stops).

A write that overflows the write-through queue can be dropped (it is counted and the flush says so); a delete
cannot. Before, a stalled lower tier let Deletes queue without bound: every one kept its keys in the queue and in
``_deleting``, and the daemon held each one's reply. Now a removal that would pass the bound is refused whole:
``RemovalQueueFull`` (the daemon: an error reply naming the limit), L1 untouched, and the next one is taken once the
queue drains. The lower tier is the write-through tests' gated ``FakeTier``; the daemon runs in this process.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures
from kvstore_fixtures import TOKEN, serving, wait_for
from pdserve.kvstore import tiered
from pdserve.kvstore.client import DaemonClient, RemovalRefused
from pdserve.kvstore.daemon import KVDaemon
from pdserve.kvstore.tiered import RemovalQueueFull
from test_kvstore_writethrough import KB, FakeTier, _put, store_of  # noqa: F401 - the gated tier and its fixture


def _queued(store) -> int:
    return store.stats()["writethrough"]["removals_queued"]


def test_a_removal_past_the_bound_is_refused_whole_and_taken_once_the_queue_drains(store_of, monkeypatch):
    monkeypatch.setattr(tiered, "MAX_QUEUED_REMOVALS", 8)
    l2 = FakeTier("l2")
    store = store_of(l2)
    _put(store, *[f"k{i}" for i in range(10)])
    assert store.flush()
    l2.gate.clear()
    _put(store, "stuck")                                   # the worker holds this write: removals queue behind it
    assert l2.entered.wait(10)
    store.delete_nowait([f"k{i}" for i in range(5)])
    store.discard_where_nowait("k5", lambda copy: True)
    store.delete_nowait(["k6", "k7"])
    assert _queued(store) == 8
    with pytest.raises(RemovalQueueFull, match="8 keys already queued .* limit 8"):
        store.delete_nowait(["k8"])
    with pytest.raises(RemovalQueueFull):
        store.discard_where_nowait("k9", lambda copy: True)
    assert _queued(store) == 8
    got = store.get(["k8", "k9"])                          # refused whole: L1 still serves both
    assert torch.equal(got[0], KB + 8) and torch.equal(got[1], KB + 9)
    l2.gate.set()
    assert store.flush() and _queued(store) == 0
    store.delete(["k8"])                                   # drained: taken, and done in every tier
    assert store.get(["k8"]) == [None] and "k8" not in l2.data and _queued(store) == 0
    assert sorted(l2.data) == ["k9", "stuck"]


def test_an_empty_queue_takes_a_removal_larger_than_the_bound(store_of, monkeypatch):
    """As a write larger than ``queue_bytes`` enters an empty queue: the bound never refuses a lone removal."""
    monkeypatch.setattr(tiered, "MAX_QUEUED_REMOVALS", 2)
    l2 = FakeTier("l2")
    store = store_of(l2)
    _put(store, "a", "b", "c")
    assert store.flush()
    store.delete(["a", "b", "c"])
    assert l2.data == {} and _queued(store) == 0


def test_a_daemon_refuses_deletes_past_the_bound_and_keeps_serving(store_of, monkeypatch):
    """Through the daemon: Deletes held behind a stuck tier fill the bound; the next one is answered at once with an
    error naming the limit (not held, not queued), another client's puts and gets go on, and once the tier moves the
    held Deletes are answered and a new Delete is taken."""
    monkeypatch.setattr(tiered, "MAX_QUEUED_REMOVALS", 4)
    l2 = FakeTier("l2")
    deleting: list[threading.Thread] = []
    with serving(KVDaemon(store_of(l2), port=0, token=TOKEN)) as daemon, opened(l2), contextlib.ExitStack() as open_:
        clients = [open_.enter_context(contextlib.closing(DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=30)))
                   for _ in range(4)]
        clients[0].put([(f"k{i}:0", KB + i) for i in range(6)])
        assert daemon.store.flush()
        l2.gate.clear()
        clients[0].put([("stuck:0", KB)])
        assert l2.entered.wait(10)
        for i in range(2):                                 # two clients, two keys each: 4 queued, both replies held
            deleting.append(threading.Thread(target=clients[i].delete, args=([f"k{2 * i}:0", f"k{2 * i + 1}:0"],)))
            deleting[-1].start()
        wait_for(lambda: len(daemon._held) == 2, what="the daemon holding both Delete replies")
        with pytest.raises(RemovalRefused, match="RemovalQueueFull: 4 keys already queued .* limit 4"):
            clients[2].delete(["k4:0"])
        assert len(daemon._held) == 2
        clients[3].put([("other:0", KB + 7)])              # the daemon still serves everyone else
        assert torch.equal(clients[3].get(["other:0", "k4:0"])[0], KB + 7)
        assert torch.equal(clients[3].get(["k4:0"])[0], KB + 4)   # the refused Delete did nothing
        l2.gate.set()
        for t in deleting:
            t.join(10)
        assert not any(t.is_alive() for t in deleting)
        clients[2].delete(["k4:0"])
        assert clients[3].get(["k4:0"]) == [None] and "k4:0" not in l2.data


@contextlib.contextmanager
def opened(*tiers: FakeTier):
    """The block; then the tiers' gates opened (a test may leave one closed), before the daemon or store stops."""
    try:
        yield
    finally:
        for tier in tiers:
            tier.gate.set()
