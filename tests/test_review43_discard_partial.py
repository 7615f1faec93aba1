"""Review 43 (minor): a multi-key Discard past the bound was *not* refused whole, though docs/kv-guarantees.md says
"a delete or discard past that is refused whole, nothing done (RemovalQueueFull ...)".

``KVDaemon._discard`` called ``discard_where_nowait`` key by key (each reserved 1 key): once the bound was hit part
way, the keys before it were already gone from L1 and queued, and the error reply -- "this removal of 1 keys was not
done" -- read as if the request did nothing. The queued ones' Removals were dropped too (not held), so a tier that
missed them was never reported (no RemovalPending). Now ``TieredStore.discards_nowait`` reserves them all at once.
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
from test_kvstore_writethrough import KB, FakeTier, store_of  # noqa: F401 - the gated tier and its fixture
from test_kvstore_removal_bound import opened as _opened


def test_a_discard_refused_past_the_bound_did_nothing(store_of, monkeypatch):
    monkeypatch.setattr(tiered, "MAX_QUEUED_REMOVALS", 2)
    l2 = FakeTier("l2")
    with serving(KVDaemon(store_of(l2), port=0, token=TOKEN)) as daemon, \
            contextlib.closing(DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=30)) as client, _opened(l2):
        objs = {f"k{i}:0": KB + i for i in range(3)}
        client.put(list(objs.items()))
        assert daemon.store.flush()
        l2.gate.clear()
        client.put([("stuck:0", KB)])
        assert l2.entered.wait(10)
        daemon.store.delete_nowait(["other:0"])            # 1 of 2 queued
        keys = ["k0:0", "k1:0", "k2:0"]
        digests = [P.digest_of(k, objs[k].numpy().tobytes()) for k in keys]
        with pytest.raises(DaemonError, match="RemovalQueueFull"):
            client._request(P.Discard(keys=keys, digests=digests))
        got = client.get(keys)                             # refused whole: L1 still serves all three
        assert all(g is not None for g in got), f"part of the refused Discard was done: {[g is None for g in got]}"
