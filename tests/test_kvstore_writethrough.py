"""TieredStore's write-through queue: what it accepts and drops, and what ``flush()`` reports.

The lower tiers here are ``FakeTier``s (in memory, with a gate that holds a put and a switch
that makes puts raise), so every case is exact and needs neither Redis nor sleeps. The node's
``--kv-writethrough-queue-bytes`` flag is followed to the embedded store at the end.
"""

from __future__ import annotations

import argparse
import logging
import threading

import pytest
import torch

from pdserve.engine import node
from pdserve.engine.config import ConfigError, KVTransferConfig
from pdserve.engine.kv.store_factory import build_node_store
from pdserve.kvstore.base import KVStore
from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore

KB = torch.zeros(250)          # 1000 bytes of float32


class FakeTier(KVStore):
    """A lower tier in a dict; ``gate`` holds puts until set, ``fail`` makes them raise."""

    def __init__(self, name: str) -> None:
        self.name, self.data, self.fail = name, {}, False
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def put(self, items):
        self.entered.set()
        assert self.gate.wait(10), "test never opened the gate"
        if self.fail:
            raise ConnectionError(f"{self.name}: connection refused")
        self.data.update((k, t.clone()) for k, t in items)

    def get(self, keys):
        return [self.data.get(k) for k in keys]

    def contains(self, keys):
        return [k in self.data for k in keys]

    def delete(self, keys):
        for k in keys:
            self.data.pop(k, None)

    def stats(self):
        return {self.name: {}}


def _put(store, *keys):
    store.put([(k, KB + i) for i, k in enumerate(keys)])


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "pdserve.kvstore.tiered" and r.levelno == logging.WARNING]


@pytest.fixture
def store_of():
    stores = []

    def make(*lower, queue_bytes=256 << 20, backoff_base_s=100.0):
        stores.append(TieredStore(MemoryTier(1 << 20), list(lower), queue_bytes, backoff_base_s, backoff_base_s))
        return stores[-1]
    yield make
    for s in stores:
        for t in s.lower:
            if isinstance(t, FakeTier):
                t.gate.set()
        s.close()


def test_batch_larger_than_the_limit_enters_an_empty_queue(store_of, tmp_path):
    """Catches: a batch bigger than queue_bytes was dropped even from an empty queue (a 70B chunk
    is bigger than 256 MiB), logged at DEBUG, and flush() still said True."""
    store = store_of(DiskTier(tmp_path, 1 << 20), queue_bytes=500)
    _put(store, "big")                                # 1000 bytes > 500-byte limit, queue empty
    assert store.flush()
    assert store.lower[0].contains(["big"]) == [True]
    assert store.stats()["writethrough"] == {"dropped": 0, "lost": 0, "queued_bytes": 0, "queued_objects": 0,
                                               "removals_queued": 0, "removals_pending": 0,
                                               "removals_abandoned": 0}


def test_full_queue_drops_warns_once_per_episode_and_flush_reports_it(store_of, caplog):
    """Catches: drops into a full queue were logged at DEBUG only and flush() returned True."""
    l2 = FakeTier("l2")
    store = store_of(l2, queue_bytes=1500)
    l2.gate.clear()
    _put(store, "a")                                  # accepted; the worker holds it in l2.put
    assert l2.entered.wait(10)
    _put(store, "b")                                  # 1000 queued + 1000 > 1500: dropped
    _put(store, "c")
    assert store.stats()["writethrough"] == {"dropped": 2, "lost": 2, "queued_bytes": 1000, "queued_objects": 1,
                                               "removals_queued": 0, "removals_pending": 0,
                                               "removals_abandoned": 0}
    assert len(_warnings(caplog)) == 1 and "--kv-writethrough-queue-bytes" in _warnings(caplog)[0]
    l2.gate.set()
    assert not store.flush()                          # b and c never reached l2
    _put(store, "d")                                  # the queue drained: accepted, the episode ends
    assert store.flush()                              # nothing lost since the previous flush
    assert sorted(l2.data) == ["a", "d"]
    l2.gate.clear()
    _put(store, "e")
    assert l2.entered.wait(10)
    _put(store, "f")                                  # a second full episode: a second warning
    l2.gate.set()
    assert not store.flush()
    assert len(_warnings(caplog)) == 2 and store.stats()["writethrough"]["dropped"] == 3


def test_failed_and_down_writes_are_counted_per_tier_and_fail_flush(store_of):
    """Catches: one ``written`` counted every tier's write under one name (3 objects to two tiers
    read 6), a put that raised was counted nowhere, and flush() returned True after it."""
    l2, l3 = FakeTier("l2"), FakeTier("l3")
    store = store_of(l2, l3)
    _put(store, "x0", "x1", "x2")
    assert store.flush()
    stats = store.stats()
    assert [stats[t]["wt_written"] for t in ("l2", "l3")] == [3, 3]
    l2.fail = True
    _put(store, "y0", "y1")                           # l2 raises: marked down (back-off 100 s)
    assert not store.flush()
    _put(store, "z")                                  # l2 down: skipped
    assert not store.flush()
    assert store.flush()                              # no writes since the previous flush
    stats = store.stats()
    assert {k: stats["l2"][k] for k in ("wt_written", "wt_failed", "wt_skipped_down", "down")} == \
        {"wt_written": 3, "wt_failed": 2, "wt_skipped_down": 1, "down": 1}
    assert (stats["l3"]["wt_written"], stats["l3"]["wt_failed"], stats["l3"]["wt_skipped_down"]) == (6, 0, 0)
    assert stats["writethrough"]["lost"] == 3 and stats["writethrough"]["dropped"] == 0


def test_flush_times_out_while_a_write_is_stuck(store_of):
    l2 = FakeTier("l2")
    store = store_of(l2)
    l2.gate.clear()
    _put(store, "slow")
    assert not store.flush(timeout_s=0.05)
    l2.gate.set()
    assert store.flush() and l2.contains(["slow"]) == [True]


def test_delete_waits_for_queued_writes_without_consuming_the_flush_report(store_of):
    l2 = FakeTier("l2")
    store = store_of(l2)
    l2.fail = True
    _put(store, "lost")
    store.delete(["other"])                           # waits for the queue, reports nothing
    assert not store.flush()


def test_node_flag_reaches_the_embedded_store(tmp_path):
    parser = argparse.ArgumentParser()
    node.register(parser.add_subparsers())
    args = parser.parse_args(["node", "--model", str(tmp_path), "--kv-store", "embedded",
                              "--kv-writethrough-queue-bytes", "777"])
    cfg = node.config_from_args(args).kv_transfer
    assert cfg.kv_writethrough_queue_bytes == 777
    store = build_node_store(cfg)
    assert store.queue_bytes == 777
    store.close()
    with pytest.raises(ConfigError, match="--kv-writethrough-queue-bytes must be >= 1, got 0"):
        KVTransferConfig(kv_writethrough_queue_bytes=0)
