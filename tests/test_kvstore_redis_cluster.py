"""The Redis tier over a real 3-node Redis Cluster (``redis+cluster://``): the scale-out path.

Keys of one put land in different hash slots, so batched writes, MGET and EXISTS cross nodes.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis
import torch

from kvstore_fixtures import free_port
from pdserve.kvstore.keys import chunk_keys, object_key
from pdserve.kvstore.redis_tier import RedisTier


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli not on PATH (.ci/run installs them)")
    workdir = tmp_path_factory.mktemp("redis-cluster")
    ports = [free_port() for _ in range(3)]
    procs = [subprocess.Popen(["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                               "--cluster-config-file", f"nodes-{p}.conf", "--save", "", "--appendonly", "no"],
                              cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
    try:
        _wait(lambda: all(_pings(p) for p in ports), "cluster nodes up")
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        _wait(lambda: all(_cluster_ok(p) for p in ports), "cluster_state:ok")
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _cluster_ok(port: int) -> bool:
    info = redis.Redis(port=port).cluster("info")
    return info.get("cluster_state") == "ok" if isinstance(info, dict) else b"cluster_state:ok" in info


def _pings(port: int) -> bool:
    try:
        return redis.Redis(port=port, socket_connect_timeout=0.2).ping()
    except redis.ConnectionError:
        return False


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise TimeoutError(what)


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
