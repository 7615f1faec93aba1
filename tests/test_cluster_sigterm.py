"""A SIGTERM to a process holding a ``LocalCluster`` ends the cluster's children (proxy/cluster.py).

The children run in their own sessions (``start_new_session``), so nothing but the parent's ``__exit__``
stops them: before ``SigtermUnwinds``, ``timeout 600 pdserve bench sweep ...`` or a script's clean-up trap
left a whole cluster running. The subprocess here holds a real store daemon and a child that is slow to stop,
and gets two SIGTERMs; both children's PIDs must be gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pdserve.proxy.cluster import ClusterSpec, LocalCluster, SigtermUnwinds

HOLDER = r"""
import subprocess, sys, time
from pdserve.proxy.cluster import Child, ClusterSpec, LocalCluster

SLOW = ("import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.5), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n")

class StoreAndSlow(LocalCluster):     # the real start-up path's first child (the store daemon), then a child
    def start(self):                  # that takes 1.5 s to stop: stop() ends it first (reverse order)
        import tempfile
        from pathlib import Path
        self.log_dir = Path(tempfile.mkdtemp(prefix="pdserve-sigterm-"))
        self._start_store()
        slow = subprocess.Popen([sys.executable, "-c", SLOW], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        assert slow.stdout.readline().strip() == "ready"
        self.children.append(Child("slow", slow, self.log_dir / "slow.log"))

with StoreAndSlow("unused", ClusterSpec()) as cluster:
    print(*(c.proc.pid for c in cluster.children), flush=True)
    BODY
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                   # a zombie is gone for our purpose (its parent has not reaped it yet)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _hold(tmp_path, body: str = "time.sleep(600)") -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.replace("BODY", body)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    line = proc.stdout.readline()
    if not line.strip():
        proc.kill()
        pytest.fail(f"the holder printed no PIDs: {proc.communicate(timeout=10)[1][-2000:]}")
    return proc, [int(p) for p in line.split()]


def _wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_sigterm_to_the_holder_ends_the_clusters_children_and_a_second_one_does_not_cut_that_short(tmp_path):
    """The second SIGTERM lands while ``stop()`` waits for the slow child: were it to raise again, the store
    daemon (stopped after it) would be left running."""
    proc, children = _hold(tmp_path)
    try:
        assert all(_alive(pid) for pid in children)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        left = [pid for pid in children if not _wait_gone(pid)]
        assert not left, f"children {left} outlived their cluster's holder"
    finally:
        for pid in (proc.pid, *children):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_sigterm_during_the_normal_stop_does_not_cut_it_short(tmp_path):
    """The block ends by itself; the SIGTERM lands while ``stop()`` waits for the slow child."""
    proc, children = _hold(tmp_path, "sys.stdin.readline()")
    try:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.communicate(timeout=10)[1][-2000:]
        left = [pid for pid in children if not _wait_gone(pid)]
        assert not left, f"children {left} outlived their cluster's holder"
    finally:
        for pid in (proc.pid, *children):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_previous_sigterm_action_comes_back_after_the_block():
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    guard = SigtermUnwinds().install()
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    guard.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_failed_start_restores_the_sigterm_action(tmp_path):
    class Broken(LocalCluster):
        def start(self):
            raise RuntimeError("no start")

    with pytest.raises(RuntimeError):
        with Broken("unused", ClusterSpec()):
            pass
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_handler_someone_set_is_left_alone():
    def mine(*_):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        guard = SigtermUnwinds().install()
        assert signal.getsignal(signal.SIGTERM) is mine
        guard.restore()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_outside_the_main_thread_nothing_is_installed():
    seen = []
    worker = threading.Thread(target=lambda: seen.append(SigtermUnwinds().install()._previous))
    worker.start()
    worker.join()
    assert seen == [None] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
