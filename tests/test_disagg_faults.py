"""Faults in the disaggregated path cost hits, never requests, and never change greedy output.

- the store's Redis tier killed mid-run          -> zero failed requests, identical output
- the store daemon killed                        -> decode recomputes, zero failed requests
- a decode node killed                           -> the proxy routes to the other one
- an object corrupted in Redis                   -> a counted miss, recomputed, identical output
- 200 requests aborted at random points          -> every KV block back on prefill and decode, no store pins
"""

from __future__ import annotations

import random

import httpx
import pytest

from kvstore_fixtures import RedisServer
from polling import wait_until
from pdserve.proxy.cluster import ClusterSpec, LocalCluster

FLAGS = ("--kv-chunk-tokens", "32", "--block-size", "16")
PROMPTS = [f"Request number {i}: the fox and the dog walk along the river bank at dawn, talking." for i in range(6)]


def _complete(url: str, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _texts(url: str, prompts=PROMPTS) -> list[str]:
    return [_complete(url, p)["choices"][0]["text"] for p in prompts]


@pytest.fixture(scope="module")
def expected(node_factory, tiny_llama) -> list[str]:
    return _texts(node_factory(tiny_llama, *FLAGS).url)


def test_redis_tier_killed_mid_run(tiny_llama, expected):
    redis_server = RedisServer().start()
    try:
        spec = ClusterSpec(node_flags=FLAGS, kv_redis=redis_server.url)
        with LocalCluster(str(tiny_llama), spec) as cluster:
            assert _texts(cluster.url, PROMPTS[:3]) == expected[:3]
            redis_server.kill()
            assert _texts(cluster.url, PROMPTS[3:]) == expected[3:]
            assert _texts(cluster.url, PROMPTS[:3]) == expected[:3]        # L1 still serves the early ones
    finally:
        redis_server.kill()


def test_store_daemon_killed_decode_recomputes(tiny_llama, expected):
    with LocalCluster(str(tiny_llama), ClusterSpec(node_flags=FLAGS)) as cluster:
        assert _texts(cluster.url, PROMPTS[:2]) == expected[:2]
        cluster.children[0].proc.kill()                                     # the kvstore daemon
        cluster.children[0].proc.wait()
        out = [_complete(cluster.url, p) for p in PROMPTS[2:]]
        assert [o["choices"][0]["text"] for o in out] == expected[2:]
        decode = out[-1]["usage"]["kv_transfer"]["decode"]
        assert decode["loaded_tokens"] == 0 and decode["recomputed_tokens"] == decode["total_tokens"]


def test_decode_node_killed_proxy_routes_elsewhere(tiny_llama, expected):
    spec = ClusterSpec(decode=2, node_flags=FLAGS, proxy_flags=("--health-interval", "0.5"))
    with LocalCluster(str(tiny_llama), spec) as cluster:
        victim = next(c for c in cluster.children if c.name == "decode-0")
        wait_until(lambda: _proxy_sees_healthy(cluster, victim.url), 30,
                   "the proxy sees the victim healthy (else its removal below proves nothing)")
        victim.proc.kill()
        victim.proc.wait()
        wait_until(lambda: not _proxy_sees_healthy(cluster, victim.url), 30,
                   "the proxy stops routing to the dead decode node")
        assert _texts(cluster.url) == expected


def _proxy_sees_healthy(cluster, url: str) -> bool:
    text = httpx.get(cluster.url + "/metrics", timeout=5).text
    port = url.rsplit(":", 1)[1]
    return any(line.startswith("pdserve_proxy_node_healthy") and port in line and line.endswith(" 1.0")
               for line in text.splitlines())


def test_corrupted_object_in_redis_is_recomputed(tiny_llama, expected):
    redis_server = RedisServer().start()
    try:
        spec = ClusterSpec(node_flags=FLAGS, kv_redis=redis_server.url, store="embedded")
        with LocalCluster(str(tiny_llama), spec) as cluster:
            prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
            first = _complete(prefill, PROMPTS[0], max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            params = first["kv_transfer_params"]
            client = redis_server.client()
            keys = client.keys("pdkv:*")
            assert keys, "prefill did not write through to Redis before answering"
            for key in keys:                                               # flip one payload byte in each
                blob = bytearray(client.get(key))
                blob[-1] ^= 0xFF
                client.set(key, bytes(blob))
            out = _complete(decode, PROMPTS[0], kv_transfer_params=params)
            assert out["choices"][0]["text"] == expected[0]
            acc = out["usage"]["kv_transfer"]["decode"]
            assert acc["store_hit_tokens"] > 0 and acc["loaded_tokens"] == 0
            # a sealed object's payload is checked by the loader's MAC, not the tier's checksum (codec FLAG_SEALED)
            name = "pdserve_kv_transfer_load_integrity_failures"
            wait_until(lambda: _metric(httpx.get(decode + "/metrics", timeout=5).text, name) >= 1, 10,
                       "the seal failure counted on the decode node (stats refreshed once a second)")
    finally:
        redis_server.kill()


def _metric(text: str, prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{prefix} not in /metrics")


def test_random_aborts_leak_nothing(tiny_llama):
    rng = random.Random(0)
    with LocalCluster(str(tiny_llama), ClusterSpec(node_flags=FLAGS)) as cluster:
        free_before = {u: _free_blocks(u) for u in cluster.prefill_urls + cluster.decode_urls}
        aborted_before = _aborted(cluster.decode_urls[0])
        with httpx.Client(timeout=60) as client:
            for i in range(200):
                _aborted_stream(client, cluster.url, f"{PROMPTS[i % 6]} {i}", rng.randint(0, 6))
        wait_until(lambda: _aborted(cluster.decode_urls[0]) - aborted_before >= 100, 30,
                   "the disconnects reached the decode node as aborts (else this test proves nothing)")
        for url, before in free_before.items():
            wait_until(lambda: _free_blocks(url) == before and _running(url) == 0, 30, f"{url} blocks back")
        pinned = 'pdserve_kvstore_pinned{model_name="llama",tier="memory"}'
        wait_until(lambda: _metric(httpx.get(cluster.decode_urls[0] + "/metrics", timeout=5).text, pinned) == 0,
                   10, "no store object pinned (stats refresh once a second)")


def _aborted(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line)


def _aborted_stream(client: httpx.Client, url: str, prompt: str, after_chunks: int) -> None:
    body = {"prompt": prompt, "max_tokens": 64, "temperature": 0.0, "ignore_eos": True, "stream": True}
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= after_chunks:
                break                                                      # closing = client disconnect


def _free_blocks(url: str) -> float:
    return _metric(httpx.get(url + "/metrics", timeout=5).text, "pdserve_kv_cache_free_blocks")


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return _metric(text, "vllm:num_requests_running") + _metric(text, "vllm:num_requests_waiting")

