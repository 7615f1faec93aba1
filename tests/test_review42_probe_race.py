"""Review of 56ed6d4 (kept removals): whether a missed removal is kept is decided by re-reading ``health.down``.

Finding (new in 56ed6d4): ``_remove_lower`` keeps what a tier missed only ``if ... self.health[tier.name].down``, and
``_retried`` drops a retried removal (settles it) unless ``self.health[tier.name].down`` -- both read AFTER the call
that missed. ``_call`` returns ``_DOWN`` without calling the tier when another thread holds the tier's probe
(``TierHealth.available``: one probe at a time). Reader threads probe too (``get``/``contains`` -> ``_fill_from_lower``
-> ``_call``): the engine's loader threads, the daemon's serve thread. When such a reader's probe is in flight as the
worker reaches the tier and succeeds before the worker reads ``down``, the removal was never done, yet:
  * a queued delete is NOT kept (``down`` is False by then), its key is uncounted, the Removal still names the tier
    (the daemon answers ``RemovalPending``: "retried once back" -- it never will be), and the deleted object is served
    again from the tier that is now up;
  * a kept removal being retried is settled as done and forgotten: the same outcome one outage later.
That is exactly the moment this commit is about: a tier coming back while readers hit it. The interleaving is forced
here by wrapping the worker's ``available()`` (the test waits for the reader's probe around it, no sleeps).

Fix: decide from the call's own result -- ``_DOWN`` (skipped) or ``_FAILED`` by an outage means missed-and-keep; only
a ``ValueError`` refusal (tier up, the request refused) is not kept -- instead of re-reading the shared health state.
"""

from __future__ import annotations

import threading

import torch

from kvstore_fixtures import wait_for
from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore
from test_kvstore_writethrough import FakeTier


class Outage(FakeTier):
    """Every call raises while ``fail`` is set; a get of ``"other"`` (the reader's) waits for ``reader_gate``."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.reader_gate, self.reader_in = threading.Event(), threading.Event()

    def get(self, keys):
        if self.fail:
            raise ConnectionError("refused")
        if keys == ["other"]:
            self.reader_in.set()
            assert self.reader_gate.wait(10)
        return super().get(keys)

    def delete(self, keys):
        if self.fail:
            raise ConnectionError("refused")
        super().delete(keys)


def _store(tier):
    store = TieredStore(MemoryTier(1 << 20), [tier], backoff_base_s=1.0, backoff_max_s=1.0)
    now = [0.0]
    store.health[tier.name] = TierHealth(tier.name, 1.0, 1.0, clock=lambda: now[0])
    return store, now


def _reader_probe_around_the_workers_call(store, tier) -> threading.Event:
    """The worker's next ``available()`` on ``tier``: a reader's probe is in flight when it asks, and succeeds right
    after (before the worker goes on). -> set once that happened."""
    health = store.health[tier.name]
    real = health.available
    fired = threading.Event()
    reader = threading.Thread(target=lambda: store.get(["other"]), daemon=True)

    def available():
        if threading.get_ident() != store._worker.ident or fired.is_set():
            return real()
        reader.start()
        assert tier.reader_in.wait(10), "the reader never probed"
        answer = real()                              # the probe is the reader's: no
        tier.reader_gate.set()
        reader.join(10)                              # the reader's probe worked: the tier is up
        fired.set()
        return answer
    health.available = available
    return fired


def test_a_delete_that_meets_a_readers_probe_is_kept():
    tier = Outage("l2")
    store, now = _store(tier)
    try:
        store.put([("k", torch.ones(8))])
        assert store.flush() and "k" in tier.data
        tier.fail = True
        store.put([("x", torch.ones(8))])
        assert not store.flush() and store.health["l2"].down      # the tier is down (back-off until now = 1)
        tier.fail, now[0] = False, 5.0                            # back; the back-off is over
        fired = _reader_probe_around_the_workers_call(store, tier)
        done = store.delete_nowait(["k"])
        assert done.wait(10) and fired.is_set()
        assert done.missed == ("l2",)                             # the tier missed it (the daemon: RemovalPending)
        assert store.stats()["writethrough"]["removals_pending"] == 1, "the missed delete was not kept"
        assert store.get(["k"]) == [None], "the deleted object is served again from the tier"
    finally:
        tier.reader_gate.set()
        store.close()


def test_a_kept_removal_whose_retry_meets_a_readers_probe_stays_kept():
    tier = Outage("l2")
    store, now = _store(tier)
    try:
        store.put([("k", torch.ones(8))])
        assert store.flush()
        tier.fail = True
        assert store.delete_nowait(["k"]).wait(10)
        assert store.stats()["writethrough"]["removals_pending"] == 1
        tier.fail = False
        fired = _reader_probe_around_the_workers_call(store, tier)
        now[0] = 5.0                                              # the idle worker retries within RETRY_S
        assert fired.wait(10)
        wait_for(lambda: store.stats()["l2"]["down"] == 0, what="the tier up")
        store.put([("y", torch.ones(8))])                         # one op more: the worker's retries run again
        assert store.flush()
        assert "k" not in tier.data, "the kept delete was dropped as done without reaching the tier"
        assert store.get(["k"]) == [None]
    finally:
        tier.reader_gate.set()
        store.close()
