"""The arena with real processes (issue 40): a client SIGKILLed mid-put, a daemon restart, processes in parallel.

A client killed while it writes into its reserved slots (half written, or written but not committed) never
leaves an object that is served: a slot is in the index only after its writer's commit, and the daemon
frees the dead client's reservation. A restarted daemon has a new arena: clients map it again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from kvstore_fixtures import TOKEN, DaemonProcess, free_port, wait_for

from pdserve.kvstore.arena import align
from pdserve.kvstore.arena_tier import ArenaTier
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.daemon import DaemonLimits, KVDaemon
from pdserve.proxy.cluster import terminate

KILLED_WRITER = """
import signal, sys, numpy as np, torch
from pdserve.kvstore.arena import ArenaMap
from pdserve.kvstore.client import DaemonClient
client = DaemonClient(sys.argv[1], token=sys.argv[2], shm_bytes=1 << 20, timeout_s=20)
client.put([("warm:0", torch.ones(10))])                      # the arena is mapped
share = {"half": 0.5, "whole": 1.0}[sys.argv[3]]

def stalled_write(self, offset, data):
    src = np.frombuffer(data, dtype=np.uint8)
    n = int(src.size * share)
    self.buf[offset:offset + n] = src[:n]
    print("WRITTEN", flush=True)
    signal.pause()                                           # killed here: the commit is never sent
ArenaMap.write = stalled_write
client.put([("torn:0", torch.full((1 << 18,), 7, dtype=torch.int32))])
"""

ROUND_TRIPS = """
import sys, torch
from pdserve.kvstore.client import DaemonClient
n = int(sys.argv[3])
with DaemonClient(sys.argv[1], token=sys.argv[2], shm_bytes=1 << 20, timeout_s=30) as client:
    for step in range(20):
        items = [(f"p{n}-{step}-{j}:0", torch.arange(n * 10_000 + step, n * 10_000 + step + 50_000)) for j in range(2)]
        client.put(items)
        got = client.get([k for k, _ in items])
        assert all(g is None or torch.equal(g, t) for g, (_, t) in zip(got, items)), "wrong bytes"
    assert client.stats()["client"]["frame_objects"] == 0
print("OK", flush=True)
"""


@pytest.fixture
def served():
    store = ArenaTier(16 << 20)
    daemon = KVDaemon(store, port=0, token=TOKEN, limits=DaemonLimits(shm_reclaim_s=0.1))
    stop = threading.Event()
    thread = threading.Thread(target=daemon.serve, args=(stop,))
    thread.start()
    yield daemon, store
    stop.set()
    thread.join()
    daemon.close()
    store.close()


@pytest.mark.parametrize("share", ["half", "whole"])
def test_a_client_killed_mid_put_leaves_nothing_served_and_its_slot_comes_back(served, share):
    daemon, store = served
    free_before = store.arena.free_bytes
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, daemon.endpoint, TOKEN, share],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "WRITTEN"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        terminate(proc)
    with DaemonClient(daemon.endpoint, token=TOKEN, shm_bytes=1 << 20, timeout_s=20) as client:
        assert client.contains(["torn:0"]) == [False] and client.get(["torn:0"]) == [None]
        wait_for(lambda: client.stats()["daemon"]["arena_cancelled"] == 1, what="the dead writer's slot freed")
        assert store.arena.free_bytes == free_before - align(40)        # only warm:0 (10 float32) is left
        want = torch.full((1 << 18,), 3, dtype=torch.int32)
        client.put([("torn:0", want)])
        assert torch.equal(client.get(["torn:0"])[0], want)


def test_clients_map_the_new_arena_after_the_daemon_restarts():
    port, want = free_port(), torch.arange(300_000, dtype=torch.int32)
    proc = DaemonProcess("--port", str(port), "--kv-cpu-bytes", str(16 << 20), "--log-level", "ERROR", token=TOKEN)
    client = DaemonClient(proc.url, token=TOKEN, shm_bytes=1 << 20, timeout_s=20)
    try:
        client.put([("before:0", want)])
        assert torch.equal(client.get(["before:0"])[0], want)
        proc.stop()
        proc = DaemonProcess("--port", str(port), "--kv-cpu-bytes", str(16 << 20), "--log-level", "ERROR",
                             token=TOKEN)
        wait_for(lambda: _answers(client), what="the client reaches the restarted daemon")
        assert client.get(["before:0"]) == [None]                # a new daemon: a new, empty arena
        client.put([("after:0", want + 1)])
        assert torch.equal(client.get(["after:0"])[0], want + 1)
        stats = client.stats()
        assert stats["client"]["arena_maps"] == 2 and stats["client"]["frame_objects"] == 0
        assert stats["daemon"]["arena_clients"] == 1
    finally:
        client.close()
        proc.stop()


def test_processes_in_parallel_put_and_get_exact_bytes():
    proc = DaemonProcess("--kv-cpu-bytes", str(64 << 20), "--log-level", "ERROR", token=TOKEN)
    kids = [subprocess.Popen([sys.executable, "-c", ROUND_TRIPS, proc.url, TOKEN, str(n)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for n in range(3)]
    try:
        outs = [kid.communicate(timeout=120) for kid in kids]
        assert [out.strip() for out, _ in outs] == ["OK"] * 3, [err[-2000:] for _, err in outs]
        with DaemonClient(proc.url, token=TOKEN, shm_bytes=1 << 20, timeout_s=20) as client:
            keys = [f"p{n}-19-{j}:0" for n in range(3) for j in range(2)]
            for key, got in zip(keys, client.get(keys)):
                n = int(key[1])
                assert torch.equal(got, torch.arange(n * 10_000 + 19, n * 10_000 + 19 + 50_000))
    finally:
        for kid in kids:
            terminate(kid)
        proc.stop()


def _answers(client: DaemonClient) -> bool:
    saved, client.timeout_ms = client.timeout_ms, 300
    try:
        return client.ping()
    except TimeoutError:
        return False
    finally:
        client.timeout_ms = saved


def test_a_tcp_client_puts_in_parts_right_after_the_daemon_restarts():
    """Frames go as several requests back to back; the first one after a restart finds no session: the client says
    Hello again and sends every part again (the restarted daemon stored none of them)."""
    port = free_port()
    items = [(f"part{i}:0", torch.full((1 << 19,), i, dtype=torch.int32)) for i in range(12)]   # 24 MiB: 6 parts
    proc = DaemonProcess("--port", str(port), "--kv-cpu-bytes", str(64 << 20), "--log-level", "ERROR", token=TOKEN)
    client = DaemonClient(proc.url, token=TOKEN, timeout_s=20)
    try:
        client.put(items[:1])
        proc.stop()
        proc = DaemonProcess("--port", str(port), "--kv-cpu-bytes", str(64 << 20), "--log-level", "ERROR",
                             token=TOKEN)
        with DaemonClient(proc.url, token=TOKEN, timeout_s=20) as probe:
            wait_for(lambda: _answers(probe), what="the restarted daemon answers")
        client.put(items)                                        # no ping first: the put meets NO_SESSION
        got = client.get([k for k, _ in items])
        assert all(torch.equal(g, t) for g, (_, t) in zip(got, items))
        assert client.stats()["client"]["frame_objects"] == 2 * len(items) + 1
    finally:
        client.close()
        proc.stop()
