"""Tier-specific behaviour: exact LRU order and budgets, pinning, disk index, promotion,
write-through drops, back-off, Redis killed and restarted under load, metrics."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures
from kvstore_fixtures import RedisServer, unique_prefix, wait_for
from pdserve.kvstore.config import KVStoreConfig, build_store
from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.metrics import render
from pdserve.kvstore.redis_tier import RedisTier
from pdserve.kvstore.tiered import TieredStore

KB = torch.zeros(250)          # 1000 bytes of float32


def _put(store, *keys):
    store.put([(k, KB + i) for i, k in enumerate(keys)])


def test_memory_lru_order_and_budget_are_exact():
    tier = MemoryTier(4000)
    _put(tier, "a", "b", "c", "d")
    tier.get(["a"])                                   # a becomes most recent
    _put(tier, "e")
    assert tier.keys_lru_order() == ["c", "d", "a", "e"]
    s = tier.stats()["memory"]
    assert (s["objects"], s["bytes"], s["evictions"]) == (4, 4000, 1)


def test_memory_pinned_entries_survive_eviction():
    tier = MemoryTier(3000)
    _put(tier, "a", "b", "c")
    with tier.borrow(["a", "b"]) as shared:
        _put(tier, "d")                               # evicts c, the only unpinned entry
        _put(tier, "e")                               # d evictable: evicted
        assert tier.keys_lru_order() == ["a", "b", "e"]
        with tier.borrow(["e"]):
            _put(tier, "f")                           # everything pinned: rejected, nothing evicted
        assert torch.equal(shared[0], KB)
    assert tier.keys_lru_order() == ["a", "b", "e"]
    tier.put([("huge", torch.zeros(1000))])           # 4000 bytes > budget: rejected
    s = tier.stats()["memory"]
    assert (s["bytes"], s["rejected"], s["evictions"]) == (3000, 2, 2)


def test_disk_lru_budget_reload_and_atomic_files(tmp_path):
    blob = len(__import__("pdserve.kvstore.codec", fromlist=["encode"]).encode(KB))
    tier = DiskTier(tmp_path, 3 * blob)
    _put(tier, "a", "b", "c")
    tier.get(["a"])
    _put(tier, "d")                                   # evicts b (a was touched)
    assert tier.contains(["a", "b", "c", "d"]) == [True, False, True, True]
    assert not tier.path_of("b").exists()
    assert tier.stats()["disk"]["bytes"] == 3 * blob
    (tmp_path / ".tmp-stray").write_bytes(b"x")       # a crashed writer's leftover
    again = DiskTier(tmp_path, 3 * blob)
    assert again.contains(["a", "c", "d"]) == [True, True, True]
    assert torch.equal(again.get(["d"])[0], KB)
    assert not list(tmp_path.glob(".tmp-*"))


def test_redis_ttl_and_prefix(redis_server):
    prefix = unique_prefix() + ":"
    tier = RedisTier(redis_server.url, prefix=prefix, ttl_s=100)
    _put(tier, "k")
    raw = redis_server.client()
    assert 0 < raw.ttl(prefix + "k") <= 100
    raw.close()
    tier.close()


def test_tiered_promotes_lower_hits_and_serves_from_disk(redis_server, tmp_path):
    store = build_store(KVStoreConfig(cpu_bytes=1 << 20, redis_url=redis_server.url,
                                      redis_prefix=unique_prefix() + ":", disk_dir=str(tmp_path), codec="lz4"))
    _put(store, "x")
    assert store.flush()
    store.l1.delete(["x"])
    assert torch.equal(store.get(["x"])[0], KB) and store.l1.contains(["x"]) == [True]
    store.l1.delete(["x"])
    store.lower[0].delete(["x"])                      # only disk has it now
    with store.borrow(["x"]) as got:
        assert torch.equal(got[0], KB)
    assert store.stats()["disk"]["hits"] == 1
    store.close()


def test_full_write_through_queue_drops_and_counts(tmp_path):
    store = TieredStore(MemoryTier(1 << 20), [DiskTier(tmp_path, 1 << 20)], queue_bytes=500)
    _put(store, "big")                                # 1000 bytes > 500-byte queue
    assert store.flush()
    assert store.stats()["writethrough"]["dropped"] == 1
    assert store.contains(["big"]) == [True] and store.lower[0].contains(["big"]) == [False]
    store.close()


def test_health_backoff_with_fake_clock():
    now = [0.0]
    h = TierHealth("redis", base_s=1.0, max_s=4.0, clock=lambda: now[0])
    h.failed(ConnectionError("refused"))
    assert not h.available()
    now[0] = 1.0
    assert h.available() and not h.available()        # one probe at a time
    h.failed(ConnectionError("refused"))              # next delay: 2s
    now[0] = 2.9
    assert not h.available()
    now[0] = 3.0
    assert h.available()
    h.ok()
    assert h.available() and h.snapshot() == {"down": 0, "consecutive_failures": 0, "marked_down": 1}


def test_redis_killed_and_restarted_under_load(own_redis, tmp_path):
    store = TieredStore(MemoryTier(64_000), [RedisTier(own_redis.url, timeout_s=0.5)],
                        backoff_base_s=0.02, backoff_max_s=0.1)
    errors, stop = [], threading.Event()

    def load():
        i = 0
        while not stop.is_set():
            try:
                _put(store, f"load{i}")
                store.get([f"load{i}", f"load{max(0, i - 100)}"])
                store.lookup([f"load{i}"], 1)
            except Exception as exc:  # noqa: BLE001 - the assertion below reports it
                errors.append(exc)
            i += 1

    worker = threading.Thread(target=load)
    worker.start()
    wait_for(lambda: store.stats()["redis"]["bytes_in"] > 0, what="writes reaching redis")
    own_redis.kill()
    wait_for(lambda: store.stats()["redis"]["down"] == 1, what="redis marked down")
    restarted = RedisServer(own_redis.port).start()             # same port, empty
    try:
        wait_for(lambda: store.stats()["redis"]["down"] == 0 and own_redis.client().dbsize() > 0,
                 timeout_s=20, what="redis back up and written")
    finally:
        stop.set()
        worker.join()
        store.close()
        restarted.kill()
    assert errors == []
    assert store.stats()["redis"]["marked_down"] >= 1


def test_metrics_export_every_tier(tmp_path):
    store = TieredStore(MemoryTier(1 << 20), [DiskTier(tmp_path, 1 << 20)])
    _put(store, "m")
    store.get(["m", "absent"])
    text = render(store).decode()
    assert 'pdserve_kvstore_hits{tier="memory"} 1.0' in text
    assert 'pdserve_kvstore_misses{tier="memory"} 1.0' in text
    assert 'pdserve_kvstore_checksum_failures{tier="disk"}' in text
    assert 'pdserve_kvstore_dropped{tier="writethrough"}' in text
    store.close()


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="--kv-codec"):
        KVStoreConfig(codec="zstd")
    with pytest.raises(ValueError, match="cpu_bytes"):
        KVStoreConfig(cpu_bytes=0)
