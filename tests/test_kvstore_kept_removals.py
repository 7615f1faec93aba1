"""Removals a lower tier missed while down are kept for it and retried (kvstore/removals.py, tiered.py).

A delete or discard that a tier misses (it is down, or the call raised) is kept for that tier; the key stays hidden
from the store's lower-tier reads meanwhile; once the tier takes calls again the write-through worker retries it
(deletes batched, each discard's test on the tier's copy). A later write of the key that reaches the tier supersedes
it (tests/test_review_held_retry_order.py); a long outage costs each op one health check
(tests/test_review_held_retry_growth.py); past ``MAX_KEYS`` a tier's missed removals, and at close every kept one, are
abandoned, counted and logged. Real Redis end to end: tests/test_review_delq_down_tier.py.
"""

from __future__ import annotations

import threading

import torch

from kvstore_fixtures import wait_for
from pdserve.kvstore import removals
from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore
from test_kvstore_writethrough import FakeTier


class Outage(FakeTier):
    """A FakeTier every call of which raises while ``fail`` is set (a Redis that refuses connections)."""

    def _check(self) -> None:
        if self.fail:
            raise ConnectionError(f"{self.name}: connection refused")

    def get(self, keys):
        self._check()
        return super().get(keys)

    def delete(self, keys):
        self._check()
        super().delete(keys)


def _store(tier: Outage) -> tuple[TieredStore, list[float]]:
    """A store over ``tier`` whose health runs on a clock the test moves (back-off: 1 s)."""
    store = TieredStore(MemoryTier(1 << 20), [tier], backoff_base_s=1.0, backoff_max_s=1.0)
    now = [0.0]
    store.health[tier.name] = TierHealth(tier.name, 1.0, 1.0, clock=lambda: now[0])
    return store, now


def _wt(store: TieredStore) -> dict:
    return store.stats()["writethrough"]


def test_a_delete_missed_while_down_is_hidden_then_done_once_the_tier_is_back():
    tier = Outage("l2")
    store, now = _store(tier)
    try:
        store.put([("k", torch.ones(8)), ("j", torch.ones(8))])
        assert store.flush() and {"k", "j"} <= set(tier.data)
        tier.fail = True
        done = store.delete_nowait(["k", "j"])
        assert done.wait(10) and done.missed == ("l2",)         # the caller learns the tier missed it
        assert _wt(store)["removals_pending"] == 2 and set(tier.data) >= {"k", "j"}
        tier.fail = False                                       # back, but backing off until now = 1
        assert store.get(["k", "j"]) == [None, None]            # hidden meanwhile: the tier still holds both
        now[0] = 5.0                                            # the back-off is over: the idle worker retries
        wait_for(lambda: _wt(store)["removals_pending"] == 0, what="the kept removals retried")
        assert "k" not in tier.data and "j" not in tier.data
        assert store.delete_nowait(["k"]).wait(10)              # every tier up: nothing missed
    finally:
        store.close()


def test_a_discard_missed_while_down_tests_the_tiers_copy_when_retried():
    tier = Outage("l2")
    store, now = _store(tier)
    refused, kept = torch.full((8,), 7.0), torch.full((8,), 3.0)
    try:
        store.put([("bad", refused), ("good", kept)])
        assert store.flush()
        tier.fail = True
        for key, copy in (("bad", refused), ("good", refused)):   # "good"'s copy is not the refused one
            assert store.discard_where_nowait(key, lambda c, r=copy: torch.equal(c, r)).wait(10)
        assert _wt(store)["removals_pending"] == 2
        tier.fail, now[0] = False, 5.0
        wait_for(lambda: _wt(store)["removals_pending"] == 0, what="the kept discards retried")
        assert "bad" not in tier.data and torch.equal(tier.data["good"], kept)
        assert torch.equal(store.get(["good"])[0], kept)        # no longer hidden
    finally:
        store.close()


def test_a_refusal_test_that_raises_on_retry_does_not_end_the_worker():
    tier = Outage("l2")
    store, now = _store(tier)
    calls = []

    def broken(copy):
        calls.append(copy)
        raise RuntimeError("refusal test broke")
    try:
        store.put([("k", torch.ones(8))])
        assert store.flush()
        tier.fail = True
        assert store.discard_where_nowait("k", broken).wait(10)   # the get raised: kept, the test not run yet
        assert _wt(store)["removals_pending"] == 1 and not calls
        tier.fail, now[0] = False, 5.0
        wait_for(lambda: _wt(store)["removals_pending"] == 0, what="the broken retry dropped")
        assert len(calls) == 1
        store.put([("after", torch.ones(8))])
        assert store.flush() and "after" in tier.data             # the worker lives on
    finally:
        store.close()


def test_removals_past_the_cap_and_at_close_are_abandoned_and_counted(monkeypatch, caplog):
    monkeypatch.setattr(removals, "MAX_KEYS", 3)
    tier = Outage("l2")
    store, _ = _store(tier)
    tier.fail = True
    try:
        assert store.delete_nowait([f"k{i}" for i in range(5)]).wait(10)
        assert _wt(store)["removals_pending"] == 3 and _wt(store)["removals_abandoned"] == 2
        assert any("not retried" in r.getMessage() for r in caplog.records)
    finally:
        store.close()
    assert store.stats()["writethrough"]["removals_abandoned"] == 5
    assert any("closing with 3 removals" in r.getMessage() for r in caplog.records)
    assert not store._deleting and not any(store._kept.values())   # nothing left hidden on their account


def test_a_tier_that_refuses_a_removal_while_up_does_not_keep_it():
    """A ValueError is the tier refusing the request, not an outage: the tier stays up and nothing is kept (it would
    be refused again before every op forever)."""
    class Refusing(Outage):
        def delete(self, keys):
            raise ValueError("not here")
    tier = Refusing("l2")
    store, _ = _store(tier)
    try:
        done = store.delete_nowait(["k"])
        assert done.wait(10) and done.missed == ("l2",)
        assert _wt(store)["removals_pending"] == 0 and store.stats()["l2"]["down"] == 0
    finally:
        store.close()


def test_the_worker_waits_idle_on_a_down_tier_without_spinning():
    """Kept removals for a tier in back-off: the idle worker looks every RETRY_S, one health check per tier."""
    tier = Outage("l2")
    store, _ = _store(tier)
    checks = []
    health = store.health["l2"]
    real = health.waiting
    health.waiting = lambda: checks.append(threading.get_ident()) or real()
    try:
        tier.fail = True
        assert store.delete_nowait(["k"]).wait(10)
        before = len(checks)
        wait_for(lambda: len(checks) > before, what="an idle retry look")
        assert len(checks) - before < 5                         # RETRY_S = 0.5 s: a handful, not a busy loop
    finally:
        store.close()


def test_a_kept_discard_holds_a_digest_not_the_refused_object():
    """(Review 42's concern) ``TieredStore.discard`` tests a tier's copy by the refused bytes' digest: a discard kept
    for a down tier keeps no reference to the refused tensor, and still removes only the refused copy."""
    import gc
    import weakref

    tier = Outage("l2")
    store, now = _store(tier)
    try:
        store.put([("bad", torch.full((8,), 7.0)), ("good", torch.full((8,), 3.0))])
        assert store.flush()
        tier.fail = True
        refused = torch.full((8,), 7.0)
        gone = weakref.ref(refused)
        store.discard("bad", refused)
        store.discard("good", torch.full((8,), 7.0))          # its copy is not these bytes: kept
        del refused
        gc.collect()
        assert gone() is None, "the kept discard holds the refused tensor"
        tier.fail, now[0] = False, 5.0
        wait_for(lambda: _wt(store)["removals_pending"] == 0, what="the kept discards retried")
        assert "bad" not in tier.data and torch.equal(tier.data["good"], torch.full((8,), 3.0))
    finally:
        store.close()
