"""Shared-memory segments and client liveness (issue 9, bug 4).

Before the fix the daemon dropped its OLDEST segment past ``max_shm_clients`` -- often a
live node's -- and that node never re-attached, so every later put failed. Now segments
of exited processes are reclaimed (on Attach at the limit, and periodically), a live
client's segment is never evicted (a new client is refused shm and uses zmq frames),
and a client whose segment the daemon lost re-attaches once and retries.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from kvstore_fixtures import DaemonProcess, free_port, wait_for
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.daemon import DaemonLimits, KVDaemon
from pdserve.kvstore.memory import MemoryTier
from pdserve.proxy.cluster import terminate

SEG = 64 << 10
_ATTACHER = """
import sys, torch
from pdserve.kvstore.client import DaemonClient
client = DaemonClient(sys.argv[1], shm_bytes=int(sys.argv[2]), timeout_s=20)
client.put([(sys.argv[3], torch.ones(4))])
print("ATTACHED", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def daemon_with():
    """``daemon_with(limits)``: a KVDaemon serving a MemoryTier from a thread of this process."""
    started = []

    def start(limits: DaemonLimits) -> KVDaemon:
        daemon = KVDaemon(MemoryTier(16 << 20), port=0, limits=limits)
        stop = threading.Event()
        thread = threading.Thread(target=daemon.serve, args=(stop,))
        thread.start()
        started.append((daemon, stop, thread))
        return daemon
    yield start
    for daemon, stop, thread in started:
        stop.set()
        thread.join()
        daemon.close()


@pytest.fixture
def attachers():
    """``attachers(url, n)``: n processes that each attach a segment and then wait to be killed."""
    procs = []

    def spawn(url: str, n: int) -> list[subprocess.Popen]:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        new = [subprocess.Popen([sys.executable, "-c", _ATTACHER, url, str(SEG), f"dead-{i}:0"], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(n)]
        procs.extend(new)
        for proc in new:
            assert proc.stdout.readline().strip() == "ATTACHED", "attacher process did not attach"
        return new
    yield spawn
    for proc in procs:
        terminate(proc)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def _round_trip(client: DaemonClient, key: str) -> None:
    want = torch.randn(256)
    client.put([(key, want)])
    assert torch.equal(client.get([key])[0], want)


def test_dead_clients_segments_are_reclaimed_and_the_live_one_keeps_shm(daemon_with, attachers):
    """Before the fix: the newcomer evicted the live client's segment (oldest) and its next put failed."""
    daemon = daemon_with(DaemonLimits(max_shm_clients=4))
    with DaemonClient(daemon.endpoint, shm_bytes=SEG, timeout_s=20) as live:
        _round_trip(live, "live-0:0")
        _kill(attachers(daemon.endpoint, 3))                   # the table is full of dead owners
        with DaemonClient(daemon.endpoint, shm_bytes=SEG, timeout_s=20) as newcomer:
            _round_trip(newcomer, "new-0:0")
            _round_trip(live, "live-1:0")
            assert newcomer.stats()["client"]["shm_refused"] == 0
        stats = live.stats()
        assert (stats["client"]["shm_attaches"], stats["client"]["frame_objects"]) == (1, 0)
        assert stats["daemon"]["shm_reclaimed"] == 3 and stats["daemon"]["shm_clients"] == 1


def test_dead_clients_segments_are_reclaimed_periodically(daemon_with, attachers):
    daemon = daemon_with(DaemonLimits(shm_reclaim_s=0.2))
    with DaemonClient(daemon.endpoint, timeout_s=20) as observer:
        procs = attachers(daemon.endpoint, 2)
        assert observer.stats()["daemon"]["shm_clients"] == 2
        _kill(procs)
        wait_for(lambda: observer.stats()["daemon"]["shm_clients"] == 0, what="dead segments reclaimed")
        assert observer.stats()["daemon"]["shm_reclaimed"] == 2


def test_at_the_limit_with_live_owners_a_new_client_uses_frames(daemon_with):
    """Before the fix: the third client evicted the first's segment and the first's next put failed."""
    daemon = daemon_with(DaemonLimits(max_shm_clients=2))
    with DaemonClient(daemon.endpoint, shm_bytes=SEG, timeout_s=20) as a, \
            DaemonClient(daemon.endpoint, shm_bytes=SEG, timeout_s=20) as b:
        _round_trip(a, "a-0:0")
        _round_trip(b, "b-0:0")
        with DaemonClient(daemon.endpoint, shm_bytes=SEG, timeout_s=20) as c:
            _round_trip(c, "c-0:0")
            _round_trip(a, "a-1:0")
            _round_trip(b, "b-1:0")
            got = c.stats()
            assert got["client"]["shm_refused"] == 1 and got["client"]["shm_objects"] == 0
            assert got["daemon"]["shm_refused"] == 1 and got["daemon"]["shm_clients"] == 2
        for client in (a, b):
            assert client.stats()["client"]["frame_objects"] == 0


def test_client_reattaches_after_the_daemon_restarts_on_the_same_port():
    """Before the fix: after the restart every shm put failed ("no shared-memory segment")."""
    port = free_port()
    proc = DaemonProcess("--port", str(port), "--no-kv-shm-arena", "--kv-cpu-bytes", str(16 << 20), "--log-level",
                         "ERROR")
    client = DaemonClient(proc.url, shm_bytes=SEG, timeout_s=20)
    try:
        _round_trip(client, "before:0")
        proc.stop()
        proc = DaemonProcess("--port", str(port), "--no-kv-shm-arena", "--kv-cpu-bytes", str(16 << 20), "--log-level",
                         "ERROR")
        wait_for(lambda: _answers(client), what="client reconnects to the restarted daemon")
        _round_trip(client, "after:0")
        stats = client.stats()
        assert stats["client"]["shm_attaches"] == 2 and stats["client"]["frame_objects"] == 0
        assert stats["daemon"]["shm_clients"] == 1
    finally:
        client.close()
        proc.stop()


def _answers(client: DaemonClient) -> bool:
    saved, client.timeout_ms = client.timeout_ms, 300
    try:
        return client.ping()
    except TimeoutError:
        return False
    finally:
        client.timeout_ms = saved


def test_close_is_idempotent_safe_from_another_thread_and_detaches(daemon_with):
    daemon = daemon_with(DaemonLimits())
    client = DaemonClient(daemon.endpoint, shm_bytes=SEG, timeout_s=20)
    _round_trip(client, "c-0:0")
    errors = []

    def load():
        for _ in range(200):
            try:
                client.get(["c-0:0"])
            except RuntimeError as exc:          # "closed": the only way a request may fail here
                errors.append(exc)
                return

    loader = threading.Thread(target=load)
    loader.start()
    closer = threading.Thread(target=client.close)
    closer.start()
    closer.join()
    loader.join()
    client.close()
    assert all("is closed" in str(e) for e in errors)
    with pytest.raises(RuntimeError, match="is closed"):
        client.get(["c-0:0"])
    with DaemonClient(daemon.endpoint, timeout_s=20) as observer:
        assert observer.stats()["daemon"]["shm_clients"] == 0


def _squat(endpoint: str, pid: int, n: int) -> list:
    """``n`` throw-away zmq identities each Attach a segment in the name of ``pid`` (issue 35, finding 4)."""
    import zmq

    from pdserve.kvstore import protocol as P
    from pdserve.kvstore.zmq_context import shared_context

    replies = []
    for i in range(n):
        sock = shared_context().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send(P.ENCODER.encode(P.Attach(pid=pid, size=SEG, id=i + 1)))
        assert sock.poll(20_000), "the daemon did not answer an Attach"
        replies.append(P.REPLY_DECODER.decode(sock.recv()))
        sock.close()
    return replies


def test_a_segment_claimed_for_a_process_that_never_maps_it_is_reclaimed(daemon_with, attachers):
    """Before: Attach(pid=<any live process>) pinned a fallocated segment in /dev/shm for that process's life
    (pid 1: for good). Now a segment lives only while the named process maps it; a real client's stays."""
    daemon = daemon_with(DaemonLimits(shm_reclaim_s=0.2, shm_map_grace_s=0.5))
    bystander = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],   # alive until stopped
                                 stdin=subprocess.PIPE)
    try:
        attachers(daemon.endpoint, 1)                              # a real client: it maps its segment
        assert all(r.ok for r in _squat(daemon.endpoint, bystander.pid, 5))
        with DaemonClient(daemon.endpoint, timeout_s=20) as observer:
            wait_for(lambda: observer.stats()["daemon"]["shm_clients"] == 1, what="squatted segments reclaimed")
            assert observer.stats()["daemon"]["shm_reclaimed"] == 5
    finally:
        terminate(bystander)


def test_all_segments_together_stay_under_the_total_cap(daemon_with, attachers):
    """A cap on every segment's bytes, not only per client: past it a new segment is refused (frames), live
    clients keep theirs."""
    daemon = daemon_with(DaemonLimits(max_shm_total_bytes=2 * SEG))
    attachers(daemon.endpoint, 2)
    refused = _squat(daemon.endpoint, os.getpid(), 1)[0]
    assert not refused.ok and "--kv-max-shm-total-bytes" in refused.error
    with DaemonClient(daemon.endpoint, shm_bytes=SEG, timeout_s=20) as late:
        _round_trip(late, "late-0:0")                              # served over zmq frames
        stats = late.stats()
        assert stats["client"]["shm_refused"] == 1 and stats["daemon"]["shm_clients"] == 2
