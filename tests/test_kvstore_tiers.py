"""Tier-specific behaviour: exact LRU order and budgets, pinning, views compacted in L1, disk index,
failed disk writes, promotion, back-off, Redis killed and restarted under load, metrics.
The write-through queue and ``flush()`` are in test_kvstore_writethrough.py."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest
import torch

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures
from kvstore_fixtures import RedisServer, unique_prefix, wait_for
from pdserve.kvstore import codec
from pdserve.kvstore.config import KVStoreConfig, build_store
from pdserve.kvstore import disk as disk_module
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


def _held_bytes(tensors) -> int:
    """Memory really held: the sum of the distinct storages behind ``tensors``."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_memory_compacts_views_so_its_budget_is_the_memory_held():
    """Catches: L1 accounted each adopted ``layers.unbind(0)`` view at its own size while any one
    surviving view kept the whole [L, ...] tensor alive (4000 bytes held under a 3000-byte budget)."""
    tier = MemoryTier(3000)
    layers = torch.arange(1000.0).reshape(4, 250)                   # [L=4, 250] float32: 4 x 1000 bytes
    tier.adopt([(f"c:{i}", view) for i, view in enumerate(layers.unbind(0))])
    assert tier.keys_lru_order() == ["c:1", "c:2", "c:3"]           # c:0 evicted
    with tier.borrow(tier.keys_lru_order()) as held:
        assert _held_bytes(held) == tier.stats()["memory"]["bytes"] == 3000
        assert all(torch.equal(t, layers[i + 1]) for i, t in enumerate(held))
    layers.zero_()                                                  # the caller's tensor no longer matters
    assert torch.equal(tier.get(["c:3"])[0], torch.arange(750.0, 1000.0))


def test_memory_adopts_a_compact_tensor_without_copying():
    tier = MemoryTier(1 << 20)
    own, transposed = torch.zeros(4, 8), torch.zeros(8, 4).t()
    tier.adopt([("own", own), ("t", transposed)])
    with tier.borrow(["own", "t"]) as (kept, compacted):
        assert kept.data_ptr() == own.data_ptr()                    # adopt stays zero-copy
        assert compacted.is_contiguous() and compacted.data_ptr() != transposed.data_ptr()


def test_disk_lru_budget_reload_and_atomic_files(tmp_path):
    blob = len(codec.encode(KB, "none", "a"))
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


def test_failed_disk_write_leaves_no_temp_file(tmp_path, monkeypatch):
    """Catches: a write that failed mid-file (ENOSPC) left its ``.tmp-*`` file behind, outside the
    budget, so a full disk stayed full."""
    tier = DiskTier(tmp_path, 1 << 20)
    _put(tier, "ok")
    real_write = disk_module.write_new_file

    def half_then_enospc(path: Path, data: bytes) -> None:
        real_write(path, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(disk_module, "write_new_file", half_then_enospc)
    with pytest.raises(OSError) as info:
        _put(tier, "full")
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert not list(tmp_path.glob(".tmp-*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [tier.path_of("ok").name]
    s = tier.stats()["disk"]
    assert (s["errors"], s["objects"], s["bytes"]) == (1, 1, len(codec.encode(KB, "none", "ok")))
    assert tier.contains(["ok", "full"]) == [True, False]


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
    raw = own_redis.client()
    _put(store, "before0", "before1", "before2")
    assert store.flush()                                       # before the kill: every write reached Redis
    assert raw.dbsize() == 3 and raw.exists("pdkv:before0", "pdkv:before1", "pdkv:before2") == 3
    s = store.stats()["redis"]
    assert (s["wt_written"], s["wt_failed"], s["wt_skipped_down"], s["down"], s["marked_down"]) == (3, 0, 0, 0, 0)
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
    restarted = None
    try:
        wait_for(lambda: store.stats()["redis"]["wt_written"] > 3, what="load writes reaching redis")
        own_redis.kill()
        wait_for(lambda: store.stats()["redis"]["down"] == 1, what="redis marked down")
        s = store.stats()["redis"]
        assert s["marked_down"] == 1 and s["errors"] >= 1      # one transition while it stays dead
        wait_for(lambda: store.stats()["redis"]["wt_skipped_down"] + store.stats()["redis"]["wt_failed"] > 0,
                 what="writes failing or skipped while redis is dead")
        _put(store, "while-dead")                              # this thread's own write, while redis is dead
        assert not store.flush()                               # lost writes are reported, not acknowledged
        restarted = RedisServer(own_redis.port).start()        # same port, empty
        wait_for(lambda: store.stats()["redis"]["down"] == 0 and raw.dbsize() > 0,
                 timeout_s=20, what="redis back up and written")
    finally:
        stop.set()
        worker.join()
    store.flush()                                              # reports the load's writes lost while down
    _put(store, "after")
    assert store.flush() and raw.exists("pdkv:after") == 1 and raw.exists("pdkv:before0") == 0
    assert errors == []
    assert store.stats()["redis"]["marked_down"] >= 1
    store.close()
    raw.close()
    if restarted is not None:
        restarted.kill()


def test_metrics_export_every_tier(tmp_path):
    store = TieredStore(MemoryTier(1 << 20), [DiskTier(tmp_path, 1 << 20)])
    _put(store, "m")
    store.get(["m", "absent"])
    assert store.flush()
    text = render(store).decode()
    assert 'pdserve_kvstore_hits_total{tier="memory"} 1.0' in text
    assert 'pdserve_kvstore_misses_total{tier="memory"} 1.0' in text
    assert 'pdserve_kvstore_checksum_failures_total{tier="disk"}' in text
    assert 'pdserve_kvstore_wt_written_total{tier="disk"} 1.0' in text
    assert 'pdserve_kvstore_dropped_total{tier="writethrough"} 0.0' in text
    assert 'pdserve_kvstore_bytes{tier="memory"} 1000.0' in text
    store.close()


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="--kv-codec"):
        KVStoreConfig(codec="zstd")
    with pytest.raises(ValueError, match="cpu_bytes must be > 0 bytes, got 0 .--kv-cpu-bytes."):
        KVStoreConfig(cpu_bytes=0)
    with pytest.raises(ValueError, match="--kv-writethrough-queue-bytes"):
        KVStoreConfig(queue_bytes=-1)


def test_only_the_probe_brings_a_tier_back_up():
    """A call admitted before the failure that succeeds afterwards must not flip the tier up.

    Mutation caught (seen as a flaky ``marked_down == 2`` under load): ``ok()`` from any thread clears
    ``down`` -> the tier flaps up and is marked down again by the next call.
    """
    now = [0.0]
    h = TierHealth("redis", base_s=1.0, max_s=4.0, clock=lambda: now[0])
    assert h.available()                                   # a writer thread is admitted while up
    other = threading.Thread(target=lambda: h.failed(ConnectionError("reset")))
    other.start()
    other.join()                                           # another thread's call fails: down
    h.ok()                                                 # the early writer's success arrives late
    assert h.snapshot()["down"] == 1
    now[0] = 1.5
    assert h.available()                                   # the probe
    h.ok()
    assert h.snapshot() == {"down": 0, "consecutive_failures": 0, "marked_down": 1}
