"""The Redis tier over a real 3-node Redis Cluster (``redis+cluster://``): the scale-out path.

Keys of one put land in different hash slots, so batched writes, MGET and EXISTS cross nodes.
"""

from __future__ import annotations

import shutil
import socket
import subprocess

import pytest
import redis
import torch

from kvstore_fixtures import free_port
from pdserve.kvstore.keys import chunk_keys, object_key
from pdserve.kvstore.redis_tier import RedisTier
from polling import wait_until


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli not on PATH (.ci/run installs them)")
    workdir = tmp_path_factory.mktemp("redis-cluster")
    nodes = [_start_node(workdir) for _ in range(3)]
    try:
        ports = [port for port, _ in nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        _wait(lambda: all(_cluster_ok(p) for p in ports), "cluster_state:ok")
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        for _, proc in nodes:
            proc.kill()
            proc.wait()


def _start_node(workdir, attempts: int = 3) -> tuple[int, subprocess.Popen]:
    """One cluster-enabled redis-server on a free port; a port taken in between is retried on another."""
    for _ in range(attempts):
        port = _cluster_port()
        log = workdir / f"redis-{port}.log"
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled",
                                 "yes", "--cluster-config-file", f"nodes-{port}.conf", "--save", "",
                                 "--appendonly", "no", "--logfile", str(log)], cwd=workdir,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: proc.poll() is not None or _pings(port), 15, f"redis-server on port {port}")
        except TimeoutError:
            pass
        if proc.poll() is None and _pings(port):
            return port, proc
        proc.kill()
        proc.wait()
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no log)"
    raise RuntimeError(f"redis-server (cluster mode) did not start after {attempts} tries; last log:\n{tail}")


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is a valid, free port too."""
    while True:
        port = free_port()
        if port + 10000 <= 65535 and _free(port + 10000):
            return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _cluster_ok(port: int) -> bool:
    info = redis.Redis(port=port).cluster("info")
    return info.get("cluster_state") == "ok" if isinstance(info, dict) else b"cluster_state:ok" in info


def _pings(port: int) -> bool:
    try:
        return redis.Redis(port=port, socket_connect_timeout=0.2).ping()
    except redis.ConnectionError:
        return False


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    def safe() -> bool:
        try:
            return bool(cond())
        except redis.RedisError:
            return False

    wait_until(safe, timeout, what)


def test_round_trip_lookup_and_delete_across_slots(redis_cluster):
    tier = RedisTier(redis_cluster, prefix="pdkv-cluster:", codec_name="lz4")
    try:
        chunks = chunk_keys(list(range(64)), 16, "fingerprint")
        items = [(object_key(c, layer), torch.randn(2, 16, 2, 8)) for c in chunks for layer in range(3)]
        tier.put(items)
        got = tier.get([k for k, _ in items])
        assert all(torch.equal(a, b) for (_, a), b in zip(items, got))
        assert tier.lookup(chunks, 3) == 4
        tier.delete([object_key(chunks[2], 1)])
        assert tier.lookup(chunks, 3) == 2
        assert tier.get([object_key(chunks[2], 1)]) == [None]
    finally:
        tier.close()
