"""/metrics never waits for the store (issue 9, defect 7).

``store.stats()`` can block: a daemon client waits up to its timeout for a stopped daemon, and longer
while the loader or publisher holds the client's lock. The node's ``/metrics`` and ``/health`` run on
the event loop, so ``AsyncEngine.stats`` must answer from a snapshot refreshed by another thread.
Mutation caught: ``AsyncEngine.stats`` calling ``store.stats()`` directly -> ``stats()`` never returns
while the store is blocked (here: until the test opens the gate).
"""

from __future__ import annotations

import threading

from polling import wait_until

from pdserve.engine.config import EngineConfig, KVTransferConfig
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.kvstore.stats_cache import StatsCache
from pdserve.kvstore.tiered import TieredStore


def test_engine_stats_answer_while_the_store_is_blocked(tiny_llama, monkeypatch):
    gate, entered = threading.Event(), threading.Event()
    real = TieredStore.stats

    def blocking_stats(self):
        entered.set()
        gate.wait()
        return real(self)

    monkeypatch.setattr(TieredStore, "stats", blocking_stats)
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), kv_transfer=KVTransferConfig(kv_store="embedded")))
    try:
        assert entered.wait(10), "the stats thread never asked the store"
        answered = threading.Event()
        threading.Thread(target=lambda: (engine.stats(), answered.set()), daemon=True).start()
        assert answered.wait(10), "engine.stats() waited for a blocked store"
        assert engine.stats().kv_store == {}              # nothing refreshed yet: an empty snapshot
        gate.set()
    finally:
        gate.set()
        engine.shutdown()


def test_cache_keeps_the_last_snapshot_when_the_store_fails():
    class Flaky:
        calls = 0

        def stats(self):
            Flaky.calls += 1
            if Flaky.calls > 1:
                raise TimeoutError("daemon stopped")
            return {"memory": {"objects": 3}}

    cache = StatsCache(Flaky(), interval_s=3600)
    try:
        wait_until(lambda: cache.get() != {}, 10, "first stats snapshot")
        assert cache.get() == {"memory": {"objects": 3}}
        cache.refresh()
        assert cache.get() == {"memory": {"objects": 3}} and cache.refresh_failures == 1
    finally:
        cache.close()
