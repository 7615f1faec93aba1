"""Review of 17c5eba (deletes and discards behind the write-through queue): the queued delete keeps the caller's list.

Finding: ``TieredStore._remove`` (kvstore/tiered.py) counts ``keys`` in ``_deleting`` and queues the *same list
object* for the worker, which deletes ``arg`` from the lower tiers and uncounts ``keys`` later (``_removed``). A
caller that reuses its list once ``delete_nowait`` returned (or once ``delete``'s 30 s wait timed out) changes what the
worker deletes and uncounts: a key not counted makes ``self._deleting.pop(key)`` raise KeyError in ``_removed``'s
``finally`` -- outside the ``try`` -- and that ends the write-through worker thread: every later write stays in L1 only,
``flush()`` is False after its timeout, ``delete()`` waits 30 s each, and the original key is masked (``_deleting``)
for good while its lower copy is never removed; the other key's lower copy is deleted though nobody deleted it.

Minimal fix: ``keys = list(keys)`` at the top of ``_remove`` (queue the copy, and ``arg = keys`` for a delete); and
uncount with ``self._deleting.pop(key, 1)`` (or inside the try) so a bookkeeping slip can never kill the worker.
"""

from __future__ import annotations

from test_kvstore_writethrough import KB, FakeTier, store_of  # noqa: F401 - the gated tier and its fixture


def test_a_caller_reusing_its_key_list_does_not_end_the_write_through_worker(store_of):
    l2 = FakeTier("l2")
    store = store_of(l2)
    store.put([("k", KB), ("j", KB + 1)])
    assert store.flush()
    l2.gate.clear()
    store.put([("stuck", KB)])                        # the worker now holds this write in l2.put
    assert l2.entered.wait(10)
    keys = ["k"]
    store.delete_nowait(keys)
    keys[0] = "j"                                     # the caller reuses its buffer of keys
    l2.gate.set()
    store.put([("after", KB + 2)])
    assert store.flush(5.0), "the write-through worker is gone: a later write never reached l2"
    assert store._worker.is_alive()
    assert l2.contains(["k", "j", "after"]) == [False, True, True]   # what was deleted: k, not j
    assert store.contains(["j"]) == [True]
