"""Regressions from the hostile review of issue 9, one per finding that was fixed.

Each docstring names the reproduction it replaces and what failed before the fix.
"""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.kvstore import protocol as P
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.daemon import KVDaemon
from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore


class _SwappingDaemon(KVDaemon):
    """Answers a get for x:0 with y:0's object: stands in for any reply/request desync."""

    def _get(self, req, ident, frames):
        req.keys = ["y:0" if k == "x:0" else k for k in req.keys]
        return super()._get(req, ident, frames)


@pytest.mark.parametrize("shm", [0, 1 << 20])
def test_client_refuses_an_object_the_reply_names_for_another_key(shm):
    """Before: the digest was checked against the reply's key, so y's object came back as x (a hit)."""
    daemon, stop = _SwappingDaemon(MemoryTier(1 << 20), port=0), threading.Event()
    server = threading.Thread(target=daemon.serve, args=(stop,))
    server.start()
    client = DaemonClient(daemon.endpoint, shm_bytes=shm)
    try:
        client.put([("x:0", torch.zeros(4)), ("y:0", torch.ones(4))])
        assert client.get(["x:0"]) == [None]
        assert client.stats()["client"]["checksum_failures"] == 1
    finally:
        client.close()
        stop.set()
        server.join()
        daemon.close()


def test_an_object_no_tier_can_store_does_not_take_the_tier_down(tmp_path):
    """Before: a 9-dimension tensor made the codec raise ValueError, which marked disk down, and the
    next 20 good writes were skipped (``wt_skipped_down 20``, ``lost 21``)."""
    store = TieredStore(MemoryTier(1 << 20), [DiskTier(tmp_path, 1 << 20)])
    try:
        store.put([("bad:0", torch.zeros([1] * 9))])
        assert not store.flush()                                # that write is lost, and reported
        store.put([(f"good:{i}", torch.ones(4)) for i in range(20)])
        assert store.flush()
        disk = store.stats()["disk"]
        assert (disk["down"], disk["wt_written"], disk["wt_failed"], disk["wt_skipped_down"]) == (0, 20, 1, 0)
    finally:
        store.close()
    with pytest.raises(ValueError, match="at most 8"):
        P.check_meta(P.ObjMeta("bad:0", "float32", [1] * 9, 4), 1 << 20)


class _FailsFor:
    """A lower tier that refuses writes of one key (stands in for a Redis error on that batch)."""

    name = "flaky"

    def __init__(self, bad_key: str):
        self.bad_key, self.keys = bad_key, set()

    def put(self, items):
        if any(k == self.bad_key for k, _ in items):
            raise ConnectionError("injected")
        self.keys.update(k for k, _ in items)

    def stats(self):
        return {self.name: {}}

    def close(self):
        pass


def test_each_writer_thread_gets_its_own_flush_report():
    """Before: writer B's flush consumed A's loss, and A's flush returned True for a write that never
    reached the lower tier (two prefill engines sharing one embedded store)."""
    tier = _FailsFor("a:0")
    store = TieredStore(MemoryTier(1 << 20), [tier], backoff_base_s=0.0)
    results, a_put = {}, threading.Event()

    def writer_a():
        store.put([("a:0", torch.zeros(4))])
        a_put.set()
        b.join()
        results["a"] = store.flush()

    def writer_b():
        a_put.wait()
        store.put([("b:0", torch.zeros(4))])
        results["b"] = store.flush()

    b = threading.Thread(target=writer_b)
    a = threading.Thread(target=writer_a)
    b.start()                                        # b waits for a's put; a joins b before its own flush
    a.start()
    a.join()
    store.close()
    assert results == {"a": False, "b": True} and tier.keys == {"b:0"}
