"""Review 43: a Delete with an invalid key leaked its keys' reservation in ``_queued_removals`` forever.

``TieredStore._remove`` counted the keys in (``_reserve_removals``) *before* ``self.l1.delete(keys)``, and L1's delete
runs ``check_key`` on every key: an invalid key raised ValueError after the reservation, and nothing ever gave it
back (no ``_uncount``: nothing was queued). Now every key is checked before anything is counted. Before, through the daemon
(whose ``_delete`` leaves the keys to the store), each Delete naming a bad key -- one request of ``max_batch`` (4096)
keys per leak -- drove ``removals_queued`` up for good; 32 such requests pinned it at ``MAX_QUEUED_REMOVALS`` and
every later delete or discard was refused (RemovalQueueFull) until the daemon restarted.
"""

from __future__ import annotations

import contextlib

import pytest

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures
from kvstore_fixtures import TOKEN, serving
from pdserve.kvstore import protocol as P
from pdserve.kvstore import tiered
from pdserve.kvstore.client import DaemonClient, DaemonError
from pdserve.kvstore.daemon import KVDaemon
from test_kvstore_writethrough import KB, FakeTier, _put, store_of  # noqa: F401 - the gated tier and its fixture


def _queued(store) -> int:
    return store.stats()["writethrough"]["removals_queued"]


def test_a_delete_refused_for_an_invalid_key_gives_its_reservation_back(store_of):
    l2 = FakeTier("l2")
    store = store_of(l2)
    _put(store, "a", "b")
    assert store.flush()
    with pytest.raises(ValueError, match="invalid store key"):
        store.delete(["a", "bad key!"])
    assert store.flush()
    assert _queued(store) == 0, "the refused delete's 2 keys stay counted as queued removals forever"


def test_bad_deletes_through_the_daemon_do_not_lock_out_every_later_delete(store_of, monkeypatch):
    """Small bound (64) to keep it quick; the real one (131072) is 32 Deletes of 4096 keys."""
    monkeypatch.setattr(tiered, "MAX_QUEUED_REMOVALS", 64)
    l2 = FakeTier("l2")
    with serving(KVDaemon(store_of(l2), port=0, token=TOKEN)) as daemon, \
            contextlib.closing(DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=30)) as client:
        client.put([("good:0", KB)])
        assert daemon.store.flush()
        for _ in range(4):                                 # a client (not ours: ours checks keys) sends bad keys
            with pytest.raises(DaemonError, match="invalid store key"):
                client._request(P.Delete(keys=[f"x{i}:0" for i in range(15)] + ["../etc/passwd"]))
        assert daemon.store.flush()
        # nothing is queued for removal: the tier is idle, every earlier removal is done
        client.delete(["good:0"])                          # (was refused: "64 keys already queued ... limit 64")
        assert client.get(["good:0"]) == [None]
        assert _queued(daemon.store) == 0


def test_with_the_real_bound_32_bad_deletes_lock_every_later_delete_out(store_of):
    """No monkeypatch: 32 Deletes of ``max_batch`` (4096) keys, each naming one bad key, pinned ``removals_queued`` at
    ``MAX_QUEUED_REMOVALS`` (131072) with nothing queued; then a Delete of a single good key was refused."""
    l2 = FakeTier("l2")
    with serving(KVDaemon(store_of(l2), port=0, token=TOKEN)) as daemon, \
            contextlib.closing(DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=30)) as client:
        client.put([("good:0", KB)])
        assert daemon.store.flush()
        batch = daemon.limits.max_batch
        for n in range(tiered.MAX_QUEUED_REMOVALS // batch):
            with pytest.raises(DaemonError, match="invalid store key"):
                client._request(P.Delete(keys=[f"x{n}-{i}:0" for i in range(batch - 1)] + ["bad key"]))
        assert daemon.store.flush()
        client.delete(["good:0"])
        assert client.get(["good:0"]) == [None]
