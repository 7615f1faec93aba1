"""review40c: a TCP get batch as ONE request (client_segment.GET_PARTS 8 -> 1) meets the daemon's pinned-send budget
all at once. ``KVDaemon._pinned_frames`` is all-or-nothing per reply: a reply whose arena slots would take the bytes in
flight past ``max_send_pinned_bytes`` (default: a quarter of the arena) goes out as a copy of EVERY frame
(``_copies``: the whole reply allocated and memcpy'd on the serve thread, ``sends_copied`` counted). Asked in eight
parts, each reply pinned an eighth and the serve loop's sweep unpinned the ones zmq had finished before the next
was built, so a batch of up to several budgets went in place; now any batch over the budget is copied whole, on
every get -- a transient second copy of the batch in the daemon, on the path this change set out to speed up.

Real ``KVDaemon`` (arena L1) and ``DaemonClient`` over tcp://127.0.0.1; objects under ``KEEP_FRAME_FROM`` (copied
into the arena by a TCP put, so a TCP get sends arena slots, pinned) and over ``TRACK_FROM`` (sent in place).
"""

from __future__ import annotations


import pytest
import torch

from kvstore_fixtures import TOKEN, cycled_objects, serving
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.config import KVStoreConfig, build_store
from pdserve.kvstore.daemon import TRACK_FROM, DaemonLimits, KVDaemon
from pdserve.kvstore.protocol import KEEP_FRAME_FROM

N, SIZE = 1024, 48 << 10          # 48 MiB of arena slots in one client batch (the client's max_batch keys)
assert TRACK_FROM <= SIZE < KEEP_FRAME_FROM


@pytest.fixture
def daemon():
    with serving(KVDaemon(build_store(KVStoreConfig(cpu_bytes=N * SIZE + (64 << 20)), arena=True), port=0, token=TOKEN,
                          limits=DaemonLimits(max_send_pinned_bytes=N * SIZE // 2))) as d:   # half the batch in flight
        yield d


def test_a_get_batch_of_two_budgets_of_arena_slots_is_sent_in_place_not_copied_whole(daemon):
    keys, objs = cycled_objects("r40c-budget", N, SIZE, 4, seed=2)
    with DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=20) as client:
        client.put([(k, objs[i % 4]) for i, k in enumerate(keys)])
        for _ in range(5):
            got = client.get(keys)
            assert all(torch.equal(t, objs[i % 4]) for i, t in enumerate(got))
            del got
        stats = client.stats()["daemon"]
    # f19ef77 (eight requests): 0 copied replies; 03385d9 (one request of 2 budgets): every get copied whole
    assert stats["sends_copied"] == 0, stats
