"""End to end with real processes: proxy -> prefill node -> KV store daemon -> decode node.

Greedy output through the disaggregated cluster equals a colocated node and HF transformers;
the official openai client streams through the proxy; a shared prefix shows store hits and loads;
the accounting comes back in ``usage.kv_transfer``.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from hf_reference import hf_greedy, hf_model
from pdserve.engine.text.tokenizer import load_tokenizer
from pdserve.proxy.cluster import ClusterSpec, LocalCluster

NODE_FLAGS = ("--kv-chunk-tokens", "32", "--block-size", "16")
LONG = ("The quick brown fox jumps over the lazy dog while the cat watches from the warm window. " * 4).strip()


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    with LocalCluster(str(tiny_llama), ClusterSpec(prefill=1, decode=1, node_flags=NODE_FLAGS)) as c:
        yield c


@pytest.fixture(scope="module")
def colocated(node_factory, tiny_llama):
    return node_factory(tiny_llama, *NODE_FLAGS)


def _complete(url: str, prompt: str, max_tokens: int = 12) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_disagg_equals_colocated_and_hf(cluster, colocated, tiny_llama):
    disagg, local = _complete(cluster.url, LONG), _complete(colocated.url, LONG)
    tok = load_tokenizer(tiny_llama)
    expected = tok.decode(hf_greedy(hf_model(tiny_llama), tok.encode(LONG), 12), skip_special_tokens=True)
    assert disagg["choices"][0]["text"] == local["choices"][0]["text"] == expected
    assert disagg["usage"]["completion_tokens"] == 12
    kv = disagg["usage"]["kv_transfer"]
    n = disagg["usage"]["prompt_tokens"]
    assert kv["prefill"]["total_tokens"] == n and kv["decode"]["total_tokens"] == n + 1
    dec = kv["decode"]               # whole blocks reused: loaded, or already in its own cache (any test order)
    assert dec["local_hit_tokens"] + dec["loaded_tokens"] == n // 16 * 16
    for figures in kv.values():
        assert figures["local_hit_tokens"] + figures["loaded_tokens"] + figures["recomputed_tokens"] \
            == figures["total_tokens"]


def test_shared_prefix_hits_the_store(cluster, colocated):
    first = _complete(cluster.url, LONG + " One more sentence about birds.")
    second = _complete(cluster.url, LONG + " A different ending about fish and the sea.")
    cold = _complete(colocated.url, LONG + " A different ending about fish and the sea.")
    assert second["choices"][0]["text"] == cold["choices"][0]["text"]
    kv = second["usage"]["kv_transfer"]
    assert kv["prefill"]["local_hit_tokens"] > 0                    # the prefill node's own prefix cache
    assert kv["decode"]["store_hit_tokens"] > 0 and kv["decode"]["loaded_tokens"] > 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == kv["prefill"]["local_hit_tokens"]
    pf = first["usage"]["kv_transfer"]["prefill"]                   # cached = what the prefill node reused
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == pf["local_hit_tokens"] + pf["loaded_tokens"]


def test_openai_client_streams_through_proxy(cluster, colocated):
    messages = [{"role": "user", "content": "Tell me about the lazy dog and the quick fox."}]
    streamed = []
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none")
    stream = client.chat.completions.create(model=_model(cluster), messages=messages, max_tokens=10,
                                            temperature=0.0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            streamed.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    direct = openai.OpenAI(base_url=colocated.url + "/v1", api_key="none").chat.completions.create(
        model=_model(cluster), messages=messages, max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True})
    assert "".join(streamed) == direct.choices[0].message.content
    assert usage.completion_tokens == 10
    assert len(streamed) >= 5          # about one token per chunk (random tokens may be partial UTF-8)


def test_node_metrics_export_accounting(cluster):
    """Sends its own request and checks the counters moved by exactly its figures (any test order)."""
    def loaded() -> float:
        text = httpx.get(cluster.decode_urls[0] + "/metrics", timeout=10).text
        assert "pdserve_kvstore_hits_total" in text and "pdserve_kv_cache_free_blocks" in text
        return _metric(text, "pdserve_kv_loaded_tokens_total")

    before = loaded()
    owls = " ".join(["Owls glide over the silent meadow while the moon rises slowly."] * 12)   # shares no prefix
    out = _complete(cluster.url, owls)
    assert loaded() - before == out["usage"]["kv_transfer"]["decode"]["loaded_tokens"] > 0


def _metric(text: str, prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{prefix} not in /metrics")


def _model(cluster) -> str:
    return httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"][0]["id"]
