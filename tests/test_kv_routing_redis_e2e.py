"""Routing by cache in a cluster without a store daemon: the nodes embed their stores and share the real Redis on
127.0.0.1:6379 (under a key prefix of this test's own, deleted after); the proxy does its batched lookup against that
Redis itself (one pipeline of EXISTS on the keys the nodes' Redis tier writes). A prompt the prefill node published
skips the prefill node the second time (store_hit), and the answer is the prefill path's."""

from __future__ import annotations

import os

import httpx
import pytest
import redis

from polling import wait_until
from pdserve.kvstore.keys import chunk_keys
from pdserve.kvstore.redis_tier import RedisTier
from pdserve.proxy.cluster import ClusterSpec, LocalCluster

REDIS = "redis://127.0.0.1:6379/0"
PREFIX = f"pdkv-routing-test-{os.getpid()}-{os.urandom(4).hex()}:"
GREEDY = {"max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    try:
        redis.Redis.from_url(REDIS, socket_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis on 127.0.0.1:6379: {exc}")
    spec = ClusterSpec(prefill=1, decode=1, kv_routing=True, store="embedded", kv_redis=REDIS,
                       node_flags=("--block-size", "4", "--kv-chunk-tokens", "8", "--kv-redis-prefix", PREFIX),
                       proxy_flags=("--routing-policy", "kv_aware"))
    try:
        with LocalCluster(str(tiny_llama), spec) as c:
            yield c
    finally:
        client = redis.Redis.from_url(REDIS)
        keys = list(client.scan_iter(match=PREFIX + "*", count=1000))
        if keys:
            client.delete(*keys)


def served(url: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(l.rsplit(" ", 1)[1]) for l in lines if l.startswith("vllm:request_success_total{"))


def complete(url: str, prompt, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prompt_redis_holds_skips_the_prefill_node(cluster):
    prompt = "the nodes share this prompt's KV through Redis, no daemon in between, " * 2
    ids = httpx.post(cluster.decode_urls[0] + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    card = httpx.get(cluster.decode_urls[0] + "/v1/models", timeout=10).json()["data"][0]["kv"]["store"]
    keys = chunk_keys(ids, card["chunk_tokens"], card["fingerprint"], include_partial=True)
    cold = complete(cluster.url, prompt, max_tokens=1, temperature=0)      # the prefill node publishes to Redis
    assert cold["usage"]["kv_transfer"]["route"]["decision"] == "prefill"
    tier = RedisTier(REDIS, PREFIX)
    try:
        wait_until(lambda: tier.lookup(keys, card["num_layers"]) == len(keys), 20, "the write-through reached Redis")
    finally:
        tier.close()
    before = served(cluster.prefill_urls[0])
    got = complete(cluster.url, prompt, **GREEDY)
    route = got["usage"]["kv_transfer"]["route"]
    assert route["decision"] == "store_hit" and route["store_hit_tokens"] == len(ids)
    assert got["usage"]["kv_transfer"]["decode"]["loaded_tokens"] > 0
    assert served(cluster.prefill_urls[0]) == before
    first = complete(cluster.prefill_urls[0], prompt, max_tokens=1, temperature=0,
                     kv_transfer_params={"do_remote_decode": True})
    want = complete(cluster.decode_urls[0], prompt, **GREEDY, kv_transfer_params=first["kv_transfer_params"])
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
