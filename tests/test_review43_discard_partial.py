"""Review 43 (minor): a multi-key Discard past the bound is *not* refused whole, though docs/kv-guarantees.md says
"a delete or discard past that is refused whole, nothing done (RemovalQueueFull ...)".

``KVDaemon._discard`` calls ``discard_where_nowait`` key by key (each reserves 1 key): once the bound is hit part way,
the keys before it are already gone from L1 and queued, and the error reply -- "this removal of 1 keys was not done"
-- reads as if the request did nothing. The queued ones' Removals are dropped too (not held), so a tier that missed
them is never reported (no RemovalPending). The request's keys are all checked up front; reserving ``len(req.keys)``
once would make the refusal whole.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures
from kvstore_fixtures import TOKEN
from pdserve.kvstore import protocol as P
from pdserve.kvstore import tiered
from pdserve.kvstore.client import DaemonClient, DaemonError
from pdserve.kvstore.daemon import KVDaemon
from test_kvstore_writethrough import KB, FakeTier, store_of  # noqa: F401 - the gated tier and its fixture


def test_a_discard_refused_past_the_bound_did_nothing(store_of, monkeypatch):
    monkeypatch.setattr(tiered, "MAX_QUEUED_REMOVALS", 2)
    l2 = FakeTier("l2")
    daemon = KVDaemon(store_of(l2), port=0, token=TOKEN)
    stop = threading.Event()
    serve = threading.Thread(target=daemon.serve, args=(stop,))
    serve.start()
    client = DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=30)
    try:
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
    finally:
        l2.gate.set()
        stop.set()
        serve.join(10)
        client.close()
        daemon.close()
