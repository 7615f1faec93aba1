"""The issue's attack, end to end: a local user without the key against `pdserve serve --kv-redis ...`.

It learns the model fingerprint from a prefill answer and the victim's token ids from /tokenize, computes the
chunk keys and writes junk KV, sealed as pdserve sealed before (a public xxh3 checksum), straight into the
store's Redis. Before keyed seals both nodes loaded it and the victim got other tokens with status 200 (and
kept getting them from the nodes' prefix caches). Now: the colocated answer, a counted seal failure, and the
daemon itself answers the attacker nothing without the token.
"""

from __future__ import annotations

import httpx
import pytest

from forgery import forge_v1, plant, victim_keys
from kvstore_fixtures import RedisServer
from polling import wait_until
from pdserve.engine.models.model_config import ModelConfig
from pdserve.kvstore import codec
from pdserve.kvstore.client import DaemonClient, DaemonError
from pdserve.proxy.cluster import ClusterSpec, LocalCluster, store_object_bytes

FLAGS = ("--kv-chunk-tokens", "32", "--block-size", "16")
PROMPT = "Victim: the fox and the dog walk along the river bank at dawn, talking of many things at length."


def _complete(url: str, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(url: str, prefix: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


@pytest.fixture(scope="module")
def colocated(node_factory, tiny_llama) -> str:
    return _complete(node_factory(tiny_llama, *FLAGS).url, PROMPT)["choices"][0]["text"]


def test_forged_kv_in_the_clusters_redis_changes_no_answer(tiny_llama, colocated):
    redis_server = RedisServer().start()
    try:
        with LocalCluster(str(tiny_llama), ClusterSpec(node_flags=FLAGS, kv_redis=redis_server.url)) as cluster:
            prefill = cluster.prefill_urls[0]
            fingerprint = _complete(prefill, "any other prompt", max_tokens=1, kv_transfer_params={
                "do_remote_decode": True})["kv_transfer_params"]["model_fingerprint"]
            ids = httpx.post(prefill + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
            cfg = ModelConfig.from_dir(tiny_llama)
            client = redis_server.client()
            planted = plant(lambda k, obj: client.set("pdkv:" + k, codec.encode(obj, "none", k)), ids, 32,
                            fingerprint, cfg.num_layers, (2, cfg.num_kv_heads, cfg.head_dim), forge_v1)
            with DaemonClient(cluster.store_url, timeout_s=20) as attacker:
                with pytest.raises(DaemonError, match="no session"):
                    attacker.lookup(victim_keys(ids, 32, fingerprint), cfg.num_layers)
            out = _complete(cluster.url, PROMPT)
            assert out["choices"][0]["text"] == colocated
            assert out["usage"]["kv_transfer"]["prefill"]["store_hit_tokens"] == len(ids)   # it did find them
            name = "pdserve_kv_transfer_load_integrity_failures"
            wait_until(lambda: _metric(prefill, name) >= 1, 10, "the seal failure counted on the prefill node")
            assert _complete(cluster.url, PROMPT)["choices"][0]["text"] == colocated       # and stays right
            assert len(planted) == cfg.num_layers * len(victim_keys(ids, 32, fingerprint))
            daemon = next(c for c in cluster.children if c.name == "kvstore")       # a review: it read 64 MiB values
            limit = int(daemon.args[daemon.args.index("--kv-max-object-bytes") + 1])
            assert limit == store_object_bytes(str(tiny_llama), FLAGS) < 1 << 20
    finally:
        redis_server.kill()
