"""``LocalCluster`` binds each HTTP child's listening socket itself and passes it down (``--fd``).

CI once saw a decode node exit with EADDRINUSE: the cluster had picked its port free, and by the time
the node bound it (after its TP ranks started) another process held it. These tests fail on that
pick-then-bind scheme: a child's port must be taken from the moment it is spawned.
"""

from __future__ import annotations

import errno
import socket
import subprocess
import sys

import httpx
import pytest

from polling import wait_until
from pdserve.engine.server.listen import bound_socket, inherited_socket
from pdserve.proxy.cluster import ClusterSpec, LocalCluster


def _bind_error(port: int) -> int:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.errno
    return 0


def test_a_spawned_proxy_holds_its_port_before_it_has_started_and_serves_on_it(tiny_llama, tmp_path):
    cluster = LocalCluster(str(tiny_llama), log_dir=tmp_path)
    child = cluster._spawn("proxy", ["proxy", "--model", str(tiny_llama), "--prefill", "http://127.0.0.1:9",
                                     "--decode", "http://127.0.0.1:9"], bound_socket("127.0.0.1", 0))
    try:
        assert child.proc.poll() is None                # still importing: nothing of its own bound yet
        assert _bind_error(child.port) == errno.EADDRINUSE
        wait_until(lambda: child.proc.poll() is not None or _answers(child.url), 120, "the proxy answers")
        assert child.proc.poll() is None, child.log.read_text()[-2000:]
        assert f"127.0.0.1:{child.port}" in child.log.read_text()   # its log names the port it serves on
    finally:
        cluster.stop()
    wait_until(lambda: _bind_error(child.port) == 0, 10, "the port is free once the proxy stopped")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code in (200, 503)
    except httpx.HTTPError:
        return False


def test_a_taken_proxy_port_fails_before_any_child_starts(tiny_llama, tmp_path):
    with bound_socket("127.0.0.1", 0) as taken:
        cluster = LocalCluster(str(tiny_llama), ClusterSpec(proxy_port=taken.getsockname()[1]), log_dir=tmp_path)
        with pytest.raises(RuntimeError, match=rf"proxy: cannot listen on 127.0.0.1:{taken.getsockname()[1]}"):
            cluster.start()
        assert cluster.children == [] and not list(tmp_path.iterdir())


def test_inherited_socket_takes_only_a_listening_tcp_socket(tmp_path):
    with bound_socket("127.0.0.1", 0) as listening:
        sock = inherited_socket(listening.fileno())
        assert sock.getsockname() == listening.getsockname()
        sock.detach()                                   # the fd stays owned by ``listening``
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, socket.socket() as unbound:
        for s in (udp, unbound):
            with pytest.raises(SystemExit, match=rf"--fd {s.fileno()}: not a listening TCP socket"):
                inherited_socket(s.fileno())
            s.getsockname()                             # still open: a refused fd is not closed under its owner
    with open(tmp_path / "f", "w") as f, pytest.raises(SystemExit, match=rf"--fd {f.fileno()}: not an open socket"):
        inherited_socket(f.fileno())
    with pytest.raises(SystemExit, match="--fd -1: not an open socket"):
        inherited_socket(-1)
    assert inherited_socket(None) is None


def test_a_node_given_a_bad_fd_exits_at_once_naming_it(tiny_llama):
    proc = subprocess.run([sys.executable, "-m", "pdserve.engine.cli", "node", "--model", str(tiny_llama),
                           "--fd", "999"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--fd 999: not an open socket" in proc.stderr, proc.stderr[-2000:]
    assert "engine ready" not in proc.stderr


def test_a_restart_whose_port_is_taken_backs_off_longer_each_time(tmp_path, caplog):
    """A child that ran for an hour died and someone took its port: each failed bind doubles the wait
    (it used to retry every second, logging the hour-old start as if the child had just exited)."""
    from pdserve.proxy.cluster import BACKOFF_MAX_S, Child

    cluster = LocalCluster("unused", log_dir=tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with bound_socket("127.0.0.1", 0) as taken:
        child = Child("node", dead, tmp_path / "node.log", port=taken.getsockname()[1], args=["node"], started_at=0.0)
        cluster.children.append(child)
        now, delays = 3600.0, []
        assert cluster.supervise(now) == []                  # exit seen after an hour up: restart in 1 s
        for _ in range(6):
            now = child.restart_at
            assert cluster.supervise(now) == [] and child.proc is dead
            delays.append(child.restart_at - now)
    assert delays == [2.0, 4.0, 8.0, 16.0, BACKOFF_MAX_S, BACKOFF_MAX_S]
    assert caplog.text.count("cannot bind its port") == 6 and caplog.text.count("exited with code") == 1


def test_serve_on_a_taken_port_says_so_and_exits_1(tiny_llama):
    with bound_socket("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "pdserve.engine.cli", "serve", "--model", str(tiny_llama),
                               "--port", str(port)], capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"pdserve serve: proxy: cannot listen on 127.0.0.1:{port} (Address already in use)" in proc.stderr
    assert "Traceback" not in proc.stderr
