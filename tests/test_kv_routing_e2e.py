"""Routing by cache with real processes (issue 40): store daemon, one prefill and one decode node, the proxy.

The proxy looks each prompt up in the daemon (with the cluster token) and follows the nodes' KV events. Checked on
the wire: a full store hit skips the prefill node (its request counter stays) and answers what the prefill path
answers, greedy and seeded; objects the store cannot serve after the lookup said hit are recomputed with no failed
request; a short prompt is prefilled by the decode node; a restarted node's blocks are forgotten and its new
process's events followed.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from polling import wait_until
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.keys import chunk_keys, object_key
from pdserve.proxy.cluster import ClusterSpec, LocalCluster

NODE_FLAGS = ("--block-size", "4", "--kv-chunk-tokens", "8")
THRESHOLD = 12
GREEDY = {"max_tokens": 8, "temperature": 0}
SEEDED = {"max_tokens": 8, "temperature": 1.0, "seed": 1234}


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    spec = ClusterSpec(prefill=1, decode=1, kv_routing=True, node_flags=NODE_FLAGS,
                       proxy_flags=("--routing-policy", "kv_aware", "--local-prefill-threshold", str(THRESHOLD)))
    with LocalCluster(str(tiny_llama), spec) as c:
        yield c


def metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def served(c: LocalCluster, role: str) -> float:
    url = c.prefill_urls[0] if role == "prefill" else c.decode_urls[0]
    return metric(url, "vllm:request_success_total")


def complete(url: str, prompt: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def prefill_path(c: LocalCluster, prompt: str, body: dict) -> dict:
    """What the proxy's prefill path does, by hand: prefill node (one token, publish), then decode node."""
    first = complete(c.prefill_urls[0], prompt, **{**body, "max_tokens": 1},
                     kv_transfer_params={"do_remote_decode": True})
    return complete(c.decode_urls[0], prompt, **body, kv_transfer_params=first["kv_transfer_params"])


def route(answer: dict) -> dict:
    return answer["usage"]["kv_transfer"]["route"]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_full_store_hit_skips_the_prefill_node_and_answers_as_the_prefill_path(cluster, sampling):
    prompt = f"{'seeded' if sampling['temperature'] else 'greedy'}: the store holds every block of this prompt " * 2
    warm = complete(cluster.url, prompt, max_tokens=1, temperature=0)     # the prefill node alone: publishes
    assert route(warm)["decision"] == "prefill"
    before = served(cluster, "prefill")
    got = complete(cluster.url, prompt, **sampling)
    assert route(got)["decision"] == "store_hit"
    assert route(got)["store_hit_tokens"] == got["usage"]["prompt_tokens"]
    assert got["usage"]["kv_transfer"]["decode"]["loaded_tokens"] > 0         # the decode node loaded it
    assert served(cluster, "prefill") == before                              # never asked
    want = prefill_path(cluster, prompt, sampling)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == sampling["max_tokens"]


def test_objects_gone_after_the_lookup_are_recomputed_and_no_request_fails(cluster):
    prompt = "the lookup says hit but the objects cannot be loaded " * 2
    ids = httpx.post(cluster.decode_urls[0] + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    card = httpx.get(cluster.decode_urls[0] + "/v1/models", timeout=10).json()["data"][0]["kv"]["store"]
    keys = chunk_keys(ids, card["chunk_tokens"], card["fingerprint"], include_partial=True)
    junk = [(object_key(k, layer), torch.zeros(8)) for k in keys for layer in range(card["num_layers"])]
    store = DaemonClient(cluster.store_url, cluster.kv_auth_token)        # objects no node sealed: unloadable
    failed_before = metric(cluster.url, "pdserve_proxy_requests_total", outcome="upstream_error")
    try:
        store.put(junk)
        got = complete(cluster.url, prompt, **GREEDY)
        store.delete([k for k, _ in junk])
    finally:
        store.close()
    assert route(got)["decision"] == "store_hit"
    decode = got["usage"]["kv_transfer"]["decode"]
    assert decode["loaded_tokens"] == 0 and decode["recomputed_tokens"] == decode["total_tokens"]
    assert metric(cluster.url, "pdserve_proxy_requests_total", outcome="upstream_error") == failed_before
    assert got["choices"][0]["text"] == prefill_path(cluster, prompt, GREEDY)["choices"][0]["text"]


def test_a_short_prompt_is_prefilled_by_the_decode_node(cluster):
    before = served(cluster, "prefill")
    short = complete(cluster.url, "hi there", **GREEDY)
    assert short["usage"]["prompt_tokens"] < THRESHOLD
    assert route(short)["decision"] == "decode_local" and served(cluster, "prefill") == before
    assert "prefill" not in short["usage"]["kv_transfer"]
    body = {"prompt": "hi there", **GREEDY, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["kv_transfer"]["route"]["decision"] == "decode_local"
    assert "".join(c["text"] for e in events for c in e["choices"]) == short["choices"][0]["text"]
    cold = complete(cluster.url, "a longer prompt that nobody sent before goes through the prefill node", **GREEDY)
    assert route(cold)["decision"] == "prefill" and served(cluster, "prefill") == before + 1
    assert metric(cluster.url, "pdserve_proxy_pd_decisions_total", decision="decode_local") >= 1


def test_a_restarted_node_is_forgotten_and_its_new_events_followed(cluster):
    decode = cluster.decode_urls[0]

    def cached() -> float:
        return metric(cluster.url, "pdserve_proxy_node_cached_blocks", role="decode", node=decode)

    wait_until(lambda: cached() > 0, 10, "the proxy knows the decode node's cached blocks")
    child = next(ch for ch in cluster.children if ch.name == "decode-0")
    child.proc.kill()
    child.proc.wait()
    wait_until(lambda: cluster.supervise() or child.proc.poll() is None and child.restarts, 30, "decode restarted")
    wait_until(lambda: httpx.get(cluster.url + "/health", timeout=5).status_code == 200 and cached() == 0 and
               metric(cluster.url, "pdserve_proxy_node_healthy", role="decode") == 1, 180,
               "the proxy forgot the old process's blocks and sees the new one healthy")
    complete(cluster.url, "after the restart, this prompt is cached by the new process " * 2, **GREEDY)
    wait_until(lambda: cached() > 0, 10, "events from the restarted node")
