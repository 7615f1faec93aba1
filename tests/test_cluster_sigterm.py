"""A SIGTERM to a process holding a ``LocalCluster`` ends the cluster's children (proxy/cluster.py).

The children run in their own sessions (``start_new_session``), so nothing but the parent's ``__exit__``
stops them: before ``SigtermUnwinds``, ``timeout 600 pdserve bench sweep ...`` or a script's clean-up trap
left a whole cluster running. The subprocesses here hold a cluster started by the real ``start()`` with two
children (a ``sleep``, and one that stops only once the test lets it: a ``release`` file) and get SIGTERMs at the
worst moments; both children's PIDs must be gone. Every window a SIGTERM must land in is held open by a file the
test creates, not by a sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

from pdserve.proxy.cluster import ClusterSpec, LocalCluster, SigtermUnwinds

HOLDER = r"""
import os, pathlib, signal, subprocess, sys, time
from pdserve.proxy.cluster import Child, ClusterSpec, LocalCluster

GATE = ("import pathlib, time\n"
        "def gate(name):      # until the test creates ``name`` (at most 60 s)\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not pathlib.Path(name).exists() and time.monotonic() < deadline:\n"
        "        time.sleep(0.02)\n")
exec(GATE)
SLOW = (GATE + "import signal, sys\n"
        "signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path('stopping').touch(), gate('release'), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    signal.pause()\n")

class TwoChildren(LocalCluster):      # the real start() (colocated: no store daemon) with, for its nodes, a
    def _start_nodes(self):           # `sleep` and then the gated child: stop() goes in reverse
        quick = subprocess.Popen(["sleep", "600"], start_new_session=True)
        self.children.append(Child("quick", quick, self.log_dir / "quick.log"))
        slow = subprocess.Popen([sys.executable, "-c", SLOW], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        self.children.append(Child("slow", slow, self.log_dir / "slow.log"))
        assert slow.stdout.readline().strip() == "ready"
        if os.environ.get("HOLD_IN_START"):            # a start-up that is still waiting for its nodes
            print(*(c.proc.pid for c in self.children), flush=True)
            while True:
                signal.pause()

    def _start_proxy(self, sock):
        sock.close()

with TwoChildren("unused", ClusterSpec(colocated=True)) as cluster:
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


IDLE = "while True:\n        signal.pause()"      # the block: idle until a signal


@contextmanager
def _holding(tmp_path, body: str = IDLE, in_start: bool = False,
             release: bool = True) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """A holder process and its cluster's children's PIDs; after the ``with``: every child must be gone (then
    whatever is left, the holder included, is SIGKILLed). ``release``: let the gated child stop as soon as it
    is asked to (else the test creates ``release`` itself)."""
    env = dict(os.environ, HOLD_IN_START="1") if in_start else None
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.replace("BODY", body)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    line = proc.stdout.readline()
    if not line.strip():
        proc.kill()
        pytest.fail(f"the holder printed no PIDs: {proc.communicate(timeout=10)[1][-2000:]}")
    children = [int(p) for p in line.split()]
    stop_releasing = threading.Event()
    if release:
        threading.Thread(target=_release_when_stopping, args=(tmp_path, stop_releasing), daemon=True).start()
    try:
        yield proc, children
        left = [pid for pid in children if not _wait_gone(pid)]
        assert not left, f"children {left} outlived their cluster's holder"
    finally:
        stop_releasing.set()
        for pid in (proc.pid, *children):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _release_when_stopping(tmp_path, done: threading.Event) -> None:
    while not done.is_set():
        if (tmp_path / "stopping").exists():
            (tmp_path / "release").touch()
            return
        done.wait(0.02)


def _poll(done, timeout_s: float = 15.0) -> bool:
    """``done()`` became true within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.02)
    return False


def _wait_gone(pid: int) -> bool:
    return _poll(lambda: not _alive(pid))


def test_sigterm_unwinds_the_block_ends_the_children_and_a_second_one_is_swallowed(tmp_path):
    """The second SIGTERM lands in the holder's own ``finally`` (held open until the test creates
    ``finally_release``): it must neither cut that short nor the stop after it (the gated child is stopped first:
    a stop cut short would leave the `sleep` running)."""
    body = ("try:\n        pathlib.Path('in_try').touch()\n        while True:\n            signal.pause()\n"
            "    finally:\n        pathlib.Path('in_finally').touch()\n        gate('finally_release')\n"
            "        print('finally done', flush=True)")
    with _holding(tmp_path, body) as (proc, children):
        assert all(_alive(pid) for pid in children)
        assert _poll(lambda: (tmp_path / "in_try").exists()), "the holder never entered its try"
        proc.send_signal(signal.SIGTERM)
        assert _poll(lambda: (tmp_path / "in_finally").exists()), "the first SIGTERM did not unwind the block"
        proc.send_signal(signal.SIGTERM)
        (tmp_path / "finally_release").touch()
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM and "finally done" in out, err[-2000:]


def test_a_sigterm_during_the_normal_stop_waits_for_it_then_exits(tmp_path):
    """The block ends by itself; the SIGTERM lands while ``stop()`` waits for the gated child (which stops only
    once the test creates ``release``, after the SIGTERM): it is raised once every child is ended."""
    with _holding(tmp_path, "sys.stdin.readline()", release=False) as (proc, _):
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert _poll(lambda: (tmp_path / "stopping").exists()), "stop() never reached the gated child"
        proc.send_signal(signal.SIGTERM)
        (tmp_path / "release").touch()
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM, proc.communicate(timeout=10)[1][-2000:]


def test_a_sigterm_during_start_up_ends_what_was_started(tmp_path):
    """The real ``start()``: the `sleep` and the gated child are up, the nodes are "loading"."""
    with _holding(tmp_path, in_start=True) as (proc, _):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM


class _NoChildren(LocalCluster):
    def start(self):
        pass


def test_the_previous_sigterm_action_comes_back_after_the_block():
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with _NoChildren("unused", ClusterSpec()):
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        with _NoChildren("unused", ClusterSpec()) as inner:          # a cluster inside a cluster: its own
            assert signal.getsignal(signal.SIGTERM) == inner._sigterm._on_sigterm
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, inner._sigterm._on_sigterm)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_sigterm_inside_held_waits_for_the_scope_to_end():
    guard = SigtermUnwinds().install()
    try:
        with pytest.raises(SystemExit) as raised:
            with guard.held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)                                       # delivered here, and kept
                reached = True
        assert reached and raised.value.code == 128 + signal.SIGTERM
    finally:
        guard.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_held_off_the_main_thread_leaves_the_sigterm_to_the_main_thread():
    """``stop()`` run by a worker thread: a SIGTERM then must still unwind the main thread, not end the worker."""
    guard = SigtermUnwinds().install()
    inside, release = threading.Event(), threading.Event()

    def work():
        with guard.held():
            inside.set()
            release.wait(5)

    worker = threading.Thread(target=work)
    try:
        with pytest.raises(SystemExit):
            worker.start()
            inside.wait(5)
            os.kill(os.getpid(), signal.SIGTERM)
            _poll(lambda: False)                                      # the handler raises here, in the main thread
    finally:
        release.set()
        worker.join()
        guard.restore()


def test_a_sigterm_while_a_child_is_spawned_leaves_it_recorded(tmp_path):
    """The spawn's race: the PID exists before it is recorded. A SIGTERM in between must not lose it."""
    spawned = []

    class SignalledMidSpawn(_NoChildren):
        def _popen(self, args, log, append, sock, secret=False):
            spawned.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)                                           # delivered before _spawn records it
            return spawned[-1]

    cluster = SignalledMidSpawn("unused", ClusterSpec(), log_dir=tmp_path)
    try:
        with pytest.raises(SystemExit):
            with cluster:
                cluster._spawn("sleeper", [])
        assert spawned and spawned[0].poll() is not None, "the child spawned under the SIGTERM was left running"
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        for proc in spawned:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


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


def test_clusters_exited_out_of_order_leave_sigterm_its_default_action(tmp_path):
    """a, then b inside it, a exits first: b's exit puts a's (finished) handler back, which must then act as
    SIGTERM's default action, not swallow it."""
    script = ("import os, signal\n"
              "from pdserve.proxy.cluster import SigtermUnwinds\n"
              "a = SigtermUnwinds().install(); b = SigtermUnwinds().install()\n"
              "a.restore(); b.restore()\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"       # SIG_DFL: the kernel ends it as the call returns
              "print('survived SIGTERM', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == -signal.SIGTERM, (done.stdout, done.stderr[-2000:])
