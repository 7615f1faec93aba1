"""Routing by cache with real processes, part 2: store daemon, one prefill and two decode nodes, the proxy.

- A proxy started after a decode node cached a prompt learns it from the node's replay socket at once, and kv_aware
  routes the prompt's next round to that node (its local prefix counts) -- before replay it counted only once the
  node cached it again.
- The prompt tokens a decode node computes itself (decode_local, the tail of a store_hit) are in its KV events like
  a prefill node's: the chat's next round goes to that node and its prefix counts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from conftest import free_port
from polling import wait_until
from pdserve.proxy.cluster import ClusterSpec, LocalCluster, terminate

NODE_FLAGS = ("--block-size", "4", "--kv-chunk-tokens", "8")
THRESHOLD = 12
GREEDY = {"max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    spec = ClusterSpec(prefill=1, decode=2, kv_routing=True, node_flags=NODE_FLAGS,
                       proxy_flags=("--routing-policy", "kv_aware", "--local-prefill-threshold", str(THRESHOLD)))
    with LocalCluster(str(tiny_llama), spec) as c:
        yield c


def metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def served(node_url: str) -> float:
    return metric(node_url, "vllm:request_success_total")


def complete(url: str, prompt: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def route(answer: dict) -> dict:
    return answer["usage"]["kv_transfer"]["route"]


def cached(proxy: str, node: str) -> float:
    return metric(proxy, "pdserve_proxy_node_cached_blocks", role="decode", node=node)


def which(c: LocalCluster, before: list[float]) -> str:
    """The decode node whose served count grew since ``before``."""
    grew = [u for u, b in zip(c.decode_urls, before) if served(u) > b]
    assert len(grew) == 1, grew
    return grew[0]


def ids(c: LocalCluster, text: str, n: int) -> list[int]:
    """The first ``n`` token ids of ``text`` (a prompt of exactly ``n`` tokens, sent as ids)."""
    got = httpx.post(c.decode_urls[0] + "/tokenize", json={"prompt": text * 8}, timeout=30).json()["tokens"]
    assert len(got) >= n
    return got[:n]


def test_decode_local_blocks_bring_the_next_round_to_that_node(cluster):
    chat = ids(cluster, "tell me about the sea and the ships on it, ", 16)
    before = [served(u) for u in cluster.decode_urls]
    a = complete(cluster.url, chat[:10], **GREEDY)                 # 10 < THRESHOLD: the decode node computes it
    assert route(a)["decision"] == "decode_local"
    node = which(cluster, before)
    wait_until(lambda: cached(cluster.url, node) >= 2, 10, "the decode node's own prompt blocks in its events")
    before = [served(u) for u in cluster.decode_urls]
    b = complete(cluster.url, chat, **GREEDY)                      # 16 >= THRESHOLD: decode_local by its 8 cached
    assert route(b) == {"decision": "decode_local", "store_hit_tokens": 0, "decode_local_hit_tokens": 8}
    assert which(cluster, before) == node


def test_a_store_hit_nodes_blocks_bring_the_next_round_to_it(cluster):
    chat = ids(cluster, "the store holds every block of this prompt and the decode node loads it, ", 26)
    complete(cluster.url, chat[:20], max_tokens=1, temperature=0)     # prefill path: the store has it
    before = [served(u) for u in cluster.decode_urls]
    a = complete(cluster.url, chat[:20], **GREEDY)
    assert route(a)["decision"] == "store_hit"
    node = which(cluster, before)
    wait_until(lambda: cached(cluster.url, node) >= 5, 10, "the loaded and computed blocks in its events")
    before = [served(u) for u in cluster.decode_urls]
    b = complete(cluster.url, chat, **GREEDY)
    # the store holds whole chunks of 8 (16 tokens of these 26), the node all 5 blocks of 4 it holds (20)
    assert route(b) == {"decision": "decode_local", "store_hit_tokens": 16, "decode_local_hit_tokens": 20}
    assert which(cluster, before) == node


def test_a_proxy_started_later_routes_by_what_a_node_cached_before(cluster, tiny_llama):
    target = cluster.decode_urls[1]
    chat = ids(cluster, "a prompt the second decode node cached before this proxy started, ", 16)
    complete(target, chat[:10], **GREEDY)                      # straight to the node: decode_local by hand
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PDSERVE_KV_AUTH_TOKEN=cluster.kv_auth_token)
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.cli", "proxy", "--model", str(tiny_llama),
                             "--port", str(port), "--prefill", *cluster.prefill_urls, "--decode", *cluster.decode_urls,
                             "--kv-store", cluster.store_url, "--routing-policy", "kv_aware",
                             "--local-prefill-threshold", str(THRESHOLD), "--expose-kv-accounting"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    try:
        wait_until(lambda: _ok(url) and cached(url, target) > 0, 60, "the new proxy replayed the node's blocks")
        assert metric(url, "pdserve_proxy_kv_events_total", outcome="replayed") >= 3    # each node, once
        before = [served(u) for u in cluster.decode_urls]
        got = complete(url, chat, **GREEDY)
        assert route(got) == {"decision": "decode_local", "store_hit_tokens": 0, "decode_local_hit_tokens": 8}
        assert which(cluster, before) == target
    finally:
        terminate(proc)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
