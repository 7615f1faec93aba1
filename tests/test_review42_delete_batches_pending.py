"""Review of 56ed6d4 (kept removals; RemovalPending): a multi-batch ``DaemonClient.delete`` stops at its first batch.

Finding (new in 56ed6d4): ``DaemonClient.delete`` sends one ``P.Delete`` per ``max_batch`` keys. Since 56ed6d4 the
daemon answers a Delete whose removal a down tier missed with ok=False ``P.PENDING`` and the client raises
``RemovalPending`` -- from inside the batch loop. While Redis is down EVERY batch gets that answer, so the first
batch's ``RemovalPending`` ends the loop: the keys of the later batches are never sent, stay in the daemon's L1 and
in every tier, and are served on the next get. The caller got ``RemovalPending`` ("removed from L1 and the tiers that
were up; retried once back") -- which is false for most of its keys: they were not removed anywhere, and nothing will
retry them. Before 56ed6d4 every batch was sent (the Delete was answered done). A delete of more than ``max_batch``
keys (1024 by default: a sequence's chunks x layers) during a Redis outage is exactly when this happens.

Fix: send every batch, then raise one ``RemovalPending`` if any batch was answered so (commit after this test's).
"""

from __future__ import annotations

import pytest
import torch

from kvstore_fixtures import TOKEN, DaemonProcess, free_port, unique_prefix
from pdserve.kvstore.client import DaemonClient, RemovalPending


def test_a_delete_of_several_batches_while_redis_is_down_sends_every_batch():
    dead = free_port()                                  # nothing listens there: a Redis that refuses connections
    daemon = DaemonProcess("--kv-cpu-bytes", str(16 << 20), "--kv-redis", f"redis://127.0.0.1:{dead}/0",
                           "--kv-redis-prefix", unique_prefix() + ":", "--log-level", "ERROR", token=TOKEN)
    try:
        with DaemonClient(daemon.url, token=TOKEN, timeout_s=10, max_batch=2) as client:
            keys = [f"k:{i}" for i in range(5)]         # three Delete batches: 2 + 2 + 1
            client.put([(k, torch.ones(64)) for k in keys])
            assert all(t is not None for t in client.get(keys))
            with pytest.raises(RemovalPending, match="redis"):
                client.delete(keys)                     # Redis missed it: pending, as 56ed6d4 means
            left = [k for k, t in zip(keys, client.get(keys)) if t is not None]
            assert left == [], f"the Delete raised RemovalPending, yet {left} were never deleted (not even from L1)"
    finally:
        daemon.stop()
