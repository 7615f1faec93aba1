"""Tenant isolation through the proxy, with real processes: proxy -> prefill node -> store daemon -> decode node.

One local cluster whose proxy has two API keys and ``--cache-salt-from-api-key``: a tenant's request for a
prompt another tenant just ran finds nothing of it -- not in the prefill node's prefix cache, not in the store,
not in the decode node's prefix cache -- while the same tenant hits all of it again. A second, stand-alone
``pdserve proxy`` on the same nodes (its defaults: no keys, accounting hidden) shows that a client's own
``cache_salt`` reaches the nodes and that ``usage.kv_transfer`` stays out of its answers.
"""

from __future__ import annotations

import httpx
import pytest

from pdserve.engine.cli import build_parser
from pdserve.proxy.cluster import ClusterSpec, LocalCluster
from test_proxy_support import ProxyProcess, proxy_factory, sse_payloads  # noqa: F401

NODE_FLAGS = ("--kv-chunk-tokens", "32", "--block-size", "16")
KEYS = ("alice-key", "bob-key")
SENTENCE = "The quick brown fox jumps over the lazy dog while the cat watches from the warm window. "


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    spec = ClusterSpec(node_flags=NODE_FLAGS, proxy_flags=("--api-key", *KEYS, "--cache-salt-from-api-key"))
    with LocalCluster(str(tiny_llama), spec) as c:
        yield c


@pytest.fixture(scope="module")
def public(cluster, tiny_llama, proxy_factory) -> ProxyProcess:
    return proxy_factory(tiny_llama, cluster.prefill_urls, cluster.decode_urls)


def _complete(url: str, prompt: str, key: str | None = None, **extra) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **extra}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _hits(answer: dict) -> dict[str, int]:
    kv = answer["usage"]["kv_transfer"]
    return {"cached": answer["usage"]["prompt_tokens_details"]["cached_tokens"],
            "prefill_local": kv["prefill"]["local_hit_tokens"], "prefill_store": kv["prefill"]["store_hit_tokens"],
            "decode_local": kv["decode"]["local_hit_tokens"]}


def test_tenants_by_api_key_never_hit_each_others_kv(cluster):
    prompt = (SENTENCE * 4).strip()
    alice = _complete(cluster.url, prompt, KEYS[0])
    bob = _complete(cluster.url, prompt, KEYS[1])
    assert _hits(bob) == {"cached": 0, "prefill_local": 0, "prefill_store": 0, "decode_local": 0}
    assert bob["choices"][0]["text"] == alice["choices"][0]["text"]
    again = _hits(_complete(cluster.url, prompt, KEYS[0]))          # the same tenant still hits
    assert again["cached"] == again["prefill_local"] > 0 and again["prefill_store"] > 0
    assert _hits(_complete(cluster.url, prompt, KEYS[1]))["cached"] > 0


def test_a_client_salt_is_mixed_with_the_tenants_not_shared_across_them(cluster):
    prompt = ("The owls stay awake. " + SENTENCE * 3).strip()            # (each test its own first words)
    _complete(cluster.url, prompt, KEYS[0], cache_salt="team")
    bob = _complete(cluster.url, prompt, KEYS[1], cache_salt="team")     # the same client salt, another key
    assert _hits(bob) == {"cached": 0, "prefill_local": 0, "prefill_store": 0, "decode_local": 0}
    assert _hits(_complete(cluster.url, prompt, KEYS[0]))["cached"] == 0        # alice without it: apart too
    assert _hits(_complete(cluster.url, prompt, KEYS[0], cache_salt="team"))["cached"] > 0


def test_keys_other_than_the_tenants_are_refused(cluster):
    r = httpx.post(cluster.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                   headers={"Authorization": "Bearer carol-key"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_client_cache_salt_reaches_the_nodes_through_a_plain_proxy(public):
    prompt = ("The fish swim deep. " + SENTENCE * 3).strip()

    def cached(**extra) -> int:
        return _complete(public.url, prompt, **extra)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="s1") == 0
    assert cached(cache_salt="s2") == 0              # another salt: nothing of s1's
    assert cached() == 0                             # no salt: nothing of either
    assert cached(cache_salt="s1") > 0 and cached() > 0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": SENTENCE, "max_tokens": 3}),
    ("/v1/completions", {"prompt": SENTENCE, "max_tokens": 1}),                       # answered by prefill
    ("/v1/completions", {"prompt": SENTENCE, "max_tokens": 3, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SENTENCE}], "max_tokens": 3,
                              "stream": True}),
])
def test_kv_accounting_is_hidden_by_a_plain_proxy(public, cluster, path, body):
    if body.get("stream"):
        body = {**body, "stream_options": {"include_usage": True}}
    hidden = _usage(public.url, path, body)
    assert "kv_transfer" not in hidden and "cached_tokens" in hidden["prompt_tokens_details"]
    shown = _usage(cluster.url, path, body, {"Authorization": f"Bearer {KEYS[0]}"})     # LocalCluster: on
    assert set(shown["kv_transfer"]) >= {"prefill"}


def test_serve_exposes_kv_accounting_by_default_and_proxy_does_not():
    parser = build_parser()
    assert parser.parse_args(["serve"]).expose_kv_accounting is True
    assert parser.parse_args(["serve", "--no-expose-kv-accounting"]).expose_kv_accounting is False
    proxy = ["proxy", "--prefill", "http://p", "--decode", "http://d", "--model", "m"]
    assert parser.parse_args(proxy).expose_kv_accounting is False
    assert parser.parse_args([*proxy, "--api-key", "a", "b", "--api-key", "c"]).api_key == ["a", "b", "c"]


def _usage(url: str, path: str, body: dict, headers: dict | None = None) -> dict:
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, headers=headers or {}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    with httpx.stream("POST", url + path, json=body, headers=headers or {}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return sse_payloads(r)[-1]["usage"]
