"""--kv-load-layerwise through real processes: store daemon, prefill node, a layerwise decode node (its engine core
in its own process: the flag crosses that boundary too), the proxy; against a colocated node."""

from __future__ import annotations

import httpx

from conftest import NodeProcess
from pdserve.proxy.cluster import ClusterSpec, LocalCluster

FLAGS = ("--kv-chunk-tokens", "32", "--block-size", "16")
PROMPTS = [" ".join(f"w{i * 7 + j}" for j in range(n)) for i, n in enumerate((40, 90, 150))]


def _complete(url: str, prompt: str) -> dict:
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_a_layerwise_decode_node_answers_like_a_colocated_node(tiny_llama):
    spec = ClusterSpec(prefill=1, decode=1, node_flags=FLAGS, decode_flags=("--kv-load-layerwise",))
    with LocalCluster(str(tiny_llama), spec) as cluster:
        node = NodeProcess(tiny_llama, *FLAGS)
        try:
            for prompt in PROMPTS:
                disagg, colocated = _complete(cluster.url, prompt), _complete(node.url, prompt)
                assert disagg["choices"][0]["text"] == colocated["choices"][0]["text"], prompt
            decode = cluster.decode_urls[0]
            assert _metric(decode, "pdserve_kv_loaded_tokens_total") >= 32 * len(PROMPTS)
            assert _metric(decode, "pdserve_kv_transfer_load_layerwise_batches_total") == len(PROMPTS)
        finally:
            node.stop()
