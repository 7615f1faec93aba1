"""Fixtures for the kvstore tests: a private redis-server, a daemon process, store factories.

Imported by tests/test_kvstore_*.py (``from kvstore_fixtures import *``); tests/conftest.py
belongs to the lead. Every process started here is stopped by PID in the fixture's
teardown, even when the test fails. Waits poll a condition with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import uuid

import pytest
import redis
import torch
from pdserve.proxy.cluster import terminate  # noqa: E402
from polling import wait_until  # noqa: E402

torch.set_num_threads(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout_s: float = 10.0, what: str = "condition"):
    return wait_until(cond, timeout_s, what)


class RedisServer:
    """A redis-server of our own on a free port (so tests may kill and corrupt it)."""

    def __init__(self, port: int | None = None) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("no redis-server binary on PATH (.ci/run installs one)")
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        wait_for(lambda: _pings(client), what=f"redis-server on port {self.port}")
        client.close()
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


TOKEN = "pdserve-test-cluster-token-0123456789"     # the suite's cluster token (kvstore/auth.py)


class DaemonProcess:
    """``python -m pdserve.kvstore`` on a free port; ``url`` once READY was printed. ``token``: the cluster token,
    handed over as a real deployment does (PDSERVE_KV_AUTH_TOKEN in its environment); None: a daemon without one."""

    def __init__(self, *flags: str, token: str | None = None) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("PDSERVE_KV_AUTH_TOKEN", None)
        if token:
            env["PDSERVE_KV_AUTH_TOKEN"] = token
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.kvstore", "--port", "0", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"daemon did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.url = line.split()[1]

    def stop(self) -> None:
        terminate(self.proc)


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.kill()


@pytest.fixture
def own_redis():
    """A redis-server only this test uses (it may be killed and restarted)."""
    server = RedisServer().start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def daemon(redis_server, tmp_path_factory):
    disk = tmp_path_factory.mktemp("daemon-disk")
    proc = DaemonProcess("--kv-cpu-bytes", str(256 << 20), "--kv-redis", redis_server.url,
                         "--kv-redis-prefix", f"d{uuid.uuid4().hex[:6]}:", "--kv-disk-dir", str(disk),
                         "--log-level", "WARNING", token=TOKEN)
    yield proc
    proc.stop()


@contextlib.contextmanager
def serving(daemon):
    """``daemon.serve`` (a ``KVDaemon``) on a thread of this process for the block; then stopped and closed, its
    store too."""
    stop = threading.Event()
    thread = threading.Thread(target=daemon.serve, args=(stop,), name="kv-daemon-serve")
    thread.start()
    try:
        yield daemon
    finally:
        stop.set()
        thread.join()
        daemon.close()
        daemon.store.close()


def cycled_objects(name: str, n: int, size: int, distinct: int, seed: int):
    """``n`` keys ``{name}-{i}:0`` and their objects: ``distinct`` random uint8 tensors of ``size`` bytes, in turn
    (-> keys, the distinct objects; key i holds objects[i % distinct])."""
    g = torch.Generator().manual_seed(seed)
    objs = [torch.randint(0, 255, (size,), dtype=torch.uint8, generator=g) for _ in range(distinct)]
    return [f"{name}-{i}:0" for i in range(n)], objs


def unique_prefix() -> str:
    return "t" + uuid.uuid4().hex[:12]
