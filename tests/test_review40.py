"""Review of issue 40: reproductions of what the hostile review found (each test failed before its fix).

- A store that hangs stalled routing for everyone: the proxy's lookups shared one ``DaemonClient``, whose lock
  serialises requests, so N concurrent requests waited up to N x 2 s (each lookup timing out in turn) and filled
  the default thread pool the proxy's other ``to_thread`` work shares.
- An object that can never fit the arena (larger than it, or than all it could free with the rest pinned) evicted
  every unpinned object before it was rejected: one put over TCP (any size up to --kv-max-object-bytes) emptied L1.
- The daemon unpinned sent arena frames in FIFO order: one stopped TCP reader kept every later reply's slots pinned.
- A node that stopped publishing (publisher dead, socket broken, process stopped: not even the 0.5 s heartbeat)
  kept its announced blocks in routing forever: kv_aware and decode_local went on crediting it with them.
- A node restarted while the wall clock stepped back (NTP) started "before" its old process: every batch of the new
  process was dropped as stale, forever -- its cache never counted in routing again.
- decode_local counted the best decode node's prefix cache even when the decode policy (round_robin, least_loaded,
  prefix_aware) could pick another node: that node then prefilled a long prompt itself, past the threshold.
- The Redis tier's gets call ``ConnectionPool.get_connection()`` without a command name, which redis-py accepts
  from 5.3 on (5.0-5.2 raise TypeError: every get an error, the tier marked down); pyproject allowed redis>=5.
- KV-event batches did not say which node sent them: a local user who took a dead node's events port could relay
  another node's live batches there (a newer epoch: accepted as the dead node's restart). The docs said only that
  node's old batches could be replayed there (dropped as stale).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import zmq

from pdserve.kvstore import protocol as P
from pdserve.kvstore.arena_tier import ArenaTier
from pdserve.proxy import kv_routing
from pdserve.proxy.inputs import Prompt, ProxyRequest
from pdserve.proxy.kv_routing import KVRouting
from pdserve.proxy.metrics import ProxyMetrics

TIMEOUT_S = 0.3
RETRY_S = 0.2
SPACE = {"fingerprint": "ab" * 16, "chunk_tokens": 8, "num_layers": 2}


@pytest.fixture
def hung_daemon():
    """A ROUTER that takes every request and never answers (a daemon stuck in a long copy, or SIGSTOPped)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    sock.close()
    ctx.term()


def request(i: int) -> ProxyRequest:
    ids = [i] * 32
    return ProxyRequest("/v1/completions", {}, [Prompt(ids, [f"{i:032x}{c}" for c in range(4)])], False, 8)


def test_a_hung_store_does_not_stall_concurrent_routing(hung_daemon, monkeypatch):
    monkeypatch.setattr(kv_routing, "STORE_TIMEOUT_S", TIMEOUT_S)
    monkeypatch.setattr(kv_routing, "STORE_RETRY_S", RETRY_S)
    metrics = ProxyMetrics()
    kv = KVRouting(metrics, store_url=hung_daemon, token="r40" * 16)
    kv.store_space, kv.block_size = dict(SPACE), 4

    async def main() -> tuple[float, list[str]]:
        start = time.monotonic()
        routes = await asyncio.gather(*[kv.plan(request(i), []) for i in range(8)])
        took = time.monotonic() - start
        later_took, later = 0.0, None
        for i in range(3):                               # known down, then probed in the background: no waits
            again = time.monotonic()
            later = await kv.plan(request(99 + i), [])
            later_took = max(later_took, time.monotonic() - again)
            await asyncio.sleep(RETRY_S)
        await kv.stop()
        return took, later_took, [r.decision for r in routes] + [later.decision]

    took, later_took, decisions = asyncio.run(main())
    assert set(decisions) == {"prefill"}                 # a miss, never a failed request
    assert took < 2.5 * TIMEOUT_S, f"8 concurrent lookups took {took:.2f} s against a hung store"
    assert later_took < TIMEOUT_S / 2, f"a lookup right after took {later_took:.2f} s"


def test_a_store_that_answers_again_is_asked_again(monkeypatch):
    import threading

    from kvstore_fixtures import TOKEN

    from pdserve.kvstore.daemon import KVDaemon
    from pdserve.kvstore.tiered import TieredStore

    monkeypatch.setattr(kv_routing, "STORE_RETRY_S", RETRY_S)
    store = TieredStore(ArenaTier(1 << 20), [])
    daemon = KVDaemon(store, port=0, token=TOKEN)
    stop = threading.Event()
    thread = threading.Thread(target=daemon.serve, args=(stop,))
    thread.start()
    metrics = ProxyMetrics()
    kv = KVRouting(metrics, store_url=daemon.endpoint, token=TOKEN)
    kv.store_space, kv.block_size = dict(SPACE), 4

    async def main() -> None:
        kv._fail()                                        # as after a timeout
        await kv.plan(request(1), [])
        deadline = time.monotonic() + 5.0
        while kv._failing:                                # probes after RETRY_S, in the background
            assert time.monotonic() < deadline, "the store was never asked again"
            await kv.plan(request(2), [])
            await asyncio.sleep(0.05)
        await kv.plan(request(3), [])
        await kv.stop()

    try:
        asyncio.run(main())
    finally:
        stop.set()
        thread.join()
        daemon.close()
        store.close()
    assert metrics.store_lookups.labels("skipped")._value.get() >= 1
    assert metrics.store_lookups.labels("miss")._value.get() == 1        # request 3 was looked up


def test_an_object_that_cannot_fit_the_arena_evicts_nothing():
    import torch

    tier = ArenaTier(64 * 1024)
    small = [(f"small-{i}", torch.full((1024,), float(i))) for i in range(12)]       # 12 x 4 KiB
    try:
        tier.put(small)
        tier.put([("too-big", torch.zeros(32 * 1024))])                              # 128 KiB > the arena
        assert tier.contains(["too-big"]) == [False]
        assert all(tier.contains([k for k, _ in small])), "a put that could not fit emptied the arena"
        pinned = tier.pin([k for k, _ in small[:10]])                                # 40 KiB pinned
        meta = P.meta_of("too-big-now", torch.zeros(8 * 1024))                       # 32 KiB: free + evictable < it
        assert tier.reserve(meta) is None
        assert all(tier.contains([k for k, _ in small])), "a reserve that could not fit evicted what it could"
        tier.unpin(pinned)
    finally:
        tier.close()


STALLED_READER = r'''
import sys
from pdserve.kvstore import protocol as P
from pdserve.kvstore.client import DaemonClient
c = DaemonClient(sys.argv[1], sys.argv[2])
with c._lock:                                  # a get whose reply this process will not read: it is stopped
    c._call(P.Ping())
    req = P.Get(keys=["big:0"] * 6)
    c._sign(req)
    c._sock.send_multipart([P.ENCODER.encode(req)])
print("sent", flush=True)
sys.stdin.readline()
'''


def test_a_stopped_tcp_reader_does_not_keep_other_clients_slots_pinned(tmp_path):
    """The daemon unpinned sent arena frames in FIFO order: a reply stuck to one stopped process kept every later
    TCP get's slots pinned (never evicted: L1 fills with pins and refuses puts)."""
    import signal
    import subprocess
    import sys
    import threading

    import torch
    from kvstore_fixtures import TOKEN, wait_for

    from pdserve.kvstore.client import DaemonClient
    from pdserve.kvstore.daemon import DaemonLimits, KVDaemon
    from pdserve.kvstore.tiered import TieredStore

    store = TieredStore(ArenaTier(256 << 20), [])
    # the order of unpinning is under test, not the cap on bytes sent in place (test_review_tcp.py): all in place
    daemon = KVDaemon(store, port=0, token=TOKEN, limits=DaemonLimits(max_send_pinned_bytes=1 << 30))
    stop = threading.Event()
    thread = threading.Thread(target=daemon.serve, args=(stop,))
    thread.start()
    child = None
    try:
        with DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=20, shm_bytes=1 << 20) as shm:
            shm.put([("big:0", torch.ones(8 << 20)), ("small:0", torch.ones(1 << 18))])      # 32 MiB, 1 MiB
        #   (into arena slots: a TCP put's frames would be sent as themselves, unpinned -- test_kvstore_arena_frames)
        with DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=20) as tcp:
            child = subprocess.Popen([sys.executable, "-P", "-c", STALLED_READER, daemon.endpoint, TOKEN],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert child.stdout.readline().strip() == "sent"
            child.send_signal(signal.SIGSTOP)
            wait_for(lambda: tcp.stats()["memory"]["pinned"] == 1, what="the stopped reader's reply pinned")
            assert torch.equal(tcp.get(["small:0"])[0], torch.ones(1 << 18))
            wait_for(lambda: tcp.stats()["memory"]["pinned"] == 1, timeout_s=3.0,
                     what="the small object unpinned once its reply was sent (the big one still pinned)")
    finally:
        if child is not None:
            child.send_signal(signal.SIGCONT)
            child.kill()
            child.wait()
        stop.set()
        thread.join()
        daemon.close()
        store.close()


def test_a_batch_relayed_from_another_nodes_socket_is_refused():
    from pdserve.engine.kv.kv_events import EventBatch, encode_batch, events_key
    from pdserve.proxy.kv_events import EventSubscriber
    from pdserve.proxy.nodes import Node

    key = events_key("k" * 32)
    metrics, x = ProxyMetrics(), Node("http://x", "decode")
    sub = EventSubscriber("k" * 32, metrics)
    try:
        x_end, y_end = "tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"
        assert sub.handle(x, encode_batch(key, EventBatch("ex", 1.0, 1, endpoint=x_end, stored=[1])), x_end) == \
            "accepted"
        # x died; a local user bound x's port and relays y's batches (y started later: a "restart" of x)
        relayed = encode_batch(key, EventBatch("ey", 2.0, 1, cleared=True, endpoint=y_end, stored=[66, 67]))
        assert sub.handle(x, relayed, x_end) == "forged"
        assert x.kv.blocks == {1} and x.kv.epoch == "ex"
    finally:
        sub._ctx.term()


def test_the_declared_redis_minimum_has_get_connection_without_a_command_name():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    low = re.search(r'"redis>=([0-9.]+)"', text).group(1)
    assert tuple(int(p) for p in low.split(".")) >= (5, 3), f"redis>={low} allows get_connection(command_name)"


def test_a_silent_node_is_credited_with_nothing():
    from pdserve.engine.kv.kv_events import EventBatch
    from pdserve.proxy import kv_state

    state = kv_state.NodeKVState()
    assert state.apply(EventBatch("e", 1.0, 1, stored=[1, 2, 3])) == "accepted"
    assert state.leading_blocks([1, 2, 3]) == 3
    state.heard -= kv_state.SILENT_S + 1                   # no batch since, not even a heartbeat
    assert state.leading_blocks([1, 2, 3]) == 0
    assert state.apply(EventBatch("e", 1.0, 2)) == "accepted"   # a heartbeat: it speaks again
    assert state.leading_blocks([1, 2, 3]) == 3


OTHER_USER_MAP = r'''
import os, sys
os.setgid(65534)
os.setuid(65534)                                  # another local user ("nobody"), without the token
try:
    fd = os.open(f"/proc/{sys.argv[1]}/fd/{sys.argv[2]}", os.O_RDONLY)
except PermissionError:
    print("refused")
else:
    print("opened", os.read(fd, 16).hex())
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_another_local_user_cannot_open_the_arena_through_proc():
    """The threat model's claim, checked: the arena's memfd opens through /proc/<daemon pid>/fd only for its user."""
    import subprocess
    import sys

    tier = ArenaTier(1 << 20)
    try:
        out = subprocess.run([sys.executable, "-I", "-c", OTHER_USER_MAP, str(os.getpid()), str(tier.arena.fd)],
                             capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "refused", (out.stdout, out.stderr)
    finally:
        tier.close()


def test_decode_local_counts_a_nodes_cache_only_when_the_decode_policy_picks_that_node():
    import time as _time

    from pdserve.proxy.nodes import Node
    from pdserve.proxy.policies import KVHint
    from pdserve.proxy.router import NodePool

    metrics = ProxyMetrics()
    kv = KVRouting(metrics, token="r40" * 16, local_prefill_threshold=32)
    kv.block_size = 4
    warm, cold = Node("http://a", "decode", healthy=True), Node("http://b", "decode", healthy=True)
    blocks = tuple(range(25))                                   # 100 tokens in blocks of 4
    warm.kv.blocks, warm.kv.heard = set(blocks), _time.monotonic()
    req = ProxyRequest("/v1/completions", {}, [Prompt([1] * 100, [], blocks)], False, 8)
    kv._hint = lambda prompt, store_tokens: KVHint(100, 4, blocks, 0)

    async def main():
        rr, aware = NodePool("decode", ("http://a", "http://b"), "round_robin", metrics), \
            NodePool("decode", ("http://a", "http://b"), "kv_aware", metrics)
        by_rr = await kv.plan(req, [warm, cold], rr.picks_by_cache)
        by_aware = await kv.plan(req, [warm, cold], aware.picks_by_cache)
        await kv.stop()
        return by_rr.decision, by_aware.decision

    assert asyncio.run(main()) == ("prefill", "decode_local")



def test_a_restart_across_a_clock_stepped_back_is_followed_once_the_old_process_is_silent():
    from pdserve.engine.kv.kv_events import EventBatch
    from pdserve.proxy import kv_state

    state = kv_state.NodeKVState()
    assert state.apply(EventBatch("old", 100.0, 1, stored=[1, 2])) == "accepted"
    assert state.apply(EventBatch("new", 99.0, 1, cleared=True)) == "stale"      # the old process still speaks
    state.heard -= kv_state.SILENT_S + 1                                           # ... and then it is gone
    assert state.apply(EventBatch("new", 99.0, 2, stored=[7])) == "reset"
    assert state.blocks == {7} and state.leading_blocks([7]) == 1
    assert state.apply(EventBatch("old", 100.0, 9, stored=[1])) == "stale"        # the old epoch never comes back
