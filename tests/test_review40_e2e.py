"""Review of issue 40 (routing by cache), with real processes: a store-hit skip answers what the prefill path answers.

The cluster of test_kv_routing_e2e (daemon, one prefill node, one decode node, proxy with kv_aware and a threshold).
Each case warms the store through the proxy (a prefill), then asks again: the answer is a ``store_hit`` and must
equal the prefill path done by hand (prefill node for one token, then decode node with its kv_transfer_params).
Covered beyond the merged tests: n > 1 seeded, logprobs, stop strings, a cache_salt tenant (another salt is no hit),
prompts of exactly a chunk boundary (the hit covers every token) and one past it.
"""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.proxy.cluster import ClusterSpec, LocalCluster
from test_kv_routing_e2e import NODE_FLAGS, THRESHOLD, complete, route

CHUNK = 8                     # --kv-chunk-tokens of NODE_FLAGS


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    spec = ClusterSpec(prefill=1, decode=1, kv_routing=True, node_flags=NODE_FLAGS,
                       proxy_flags=("--routing-policy", "kv_aware", "--local-prefill-threshold", str(THRESHOLD)))
    with LocalCluster(str(tiny_llama), spec) as c:
        yield c


def by_hand(c: LocalCluster, prompt, body: dict) -> dict:
    first = complete(c.prefill_urls[0], prompt, **{**body, "max_tokens": 1, "n": 1},
                     kv_transfer_params={"do_remote_decode": True})
    return complete(c.decode_urls[0], prompt, **body, kv_transfer_params=first["kv_transfer_params"])


def hit(c: LocalCluster, prompt, body: dict) -> dict:
    extra = {"cache_salt": body["cache_salt"]} if "cache_salt" in body else {}
    warm = complete(c.url, prompt, max_tokens=1, temperature=0, **extra)
    assert route(warm)["decision"] == "prefill"
    got = complete(c.url, prompt, **body)
    assert route(got)["decision"] == "store_hit", route(got)
    return got


def texts(answer: dict) -> list[str]:
    return [ch["text"] for ch in sorted(answer["choices"], key=lambda ch: ch["index"])]


CASES = {
    "seeded_n2": {"max_tokens": 6, "temperature": 1.0, "seed": 77, "n": 2},
    "greedy_logprobs": {"max_tokens": 6, "temperature": 0, "logprobs": 2},
    "stop_string": {"max_tokens": 12, "temperature": 0, "stop": ["e"]},
    "cache_salt": {"max_tokens": 6, "temperature": 0, "cache_salt": "tenant-a"},
    "guided_regex": {"max_tokens": 12, "temperature": 0.8, "seed": 5, "guided_regex": "[a-z]{3}-[0-9]{2}"},
    "json_object": {"max_tokens": 24, "temperature": 0, "response_format": {"type": "json_object"}},
}


@pytest.mark.parametrize("case", list(CASES))
def test_store_hit_answers_as_the_prefill_path(cluster, case):
    body = CASES[case]
    prompt = f"review forty, case {case}: every block of this prompt is in the store " * 2
    got = hit(cluster, prompt, body)
    want = by_hand(cluster, prompt, body)
    assert texts(got) == texts(want)
    assert [ch["finish_reason"] for ch in got["choices"]] == [ch["finish_reason"] for ch in want["choices"]]
    if "logprobs" in body:
        for g, w in zip(got["choices"], want["choices"]):
            assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
            assert g["logprobs"]["token_logprobs"] == pytest.approx(w["logprobs"]["token_logprobs"], abs=1e-3)
    if "cache_salt" in body:                          # another tenant's request is no hit on tenant-a's KV
        other = complete(cluster.url, prompt, **{**body, "cache_salt": "tenant-b"})
        assert route(other)["decision"] == "prefill" and route(other)["store_hit_tokens"] == 0


@pytest.mark.parametrize("extra", [0, 1], ids=["exactly_two_chunks", "one_past"])
def test_store_hit_at_a_chunk_boundary_answers_as_the_prefill_path(cluster, extra):
    ids = [(37 * i + 11 * extra) % 200 + 5 for i in range(2 * CHUNK + extra)]
    body = {"max_tokens": 6, "temperature": 0}
    got = hit(cluster, ids, body)
    assert route(got)["store_hit_tokens"] == len(ids)
    assert texts(got) == texts(by_hand(cluster, ids, body))


def test_store_hit_stream_equals_non_stream_and_prompt_logprobs_never_skip(cluster):
    prompt = "review forty: streamed from a store hit, token for token as the prefill path " * 2
    body = {"max_tokens": 8, "temperature": 1.0, "seed": 9}
    got = hit(cluster, prompt, body)
    stream = {"prompt": prompt, **body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=stream, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["kv_transfer"]["route"]["decision"] == "store_hit"
    assert "".join(c["text"] for e in events for c in e["choices"]) == texts(got)[0] == texts(by_hand(cluster, prompt,
                                                                                                       body))[0]
    for extra in ({"echo": True}, {"prompt_logprobs": 1}):       # the prefill node computes the prompt's logprobs
        assert route(complete(cluster.url, prompt, max_tokens=2, temperature=0, **extra))["decision"] == "prefill"


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a", "b"]}}}]


def without_ids(message: dict) -> dict:
    """The message with its tool calls' ids (random per answer) left out."""
    calls = [{k: v for k, v in call.items() if k != "id"} for call in message.get("tool_calls") or ()]
    return {**message, "tool_calls": calls}


def chat(url: str, messages: list, **body) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("extra", [{"tools": TOOLS, "tool_choice": "required"},
                                   {"response_format": {"type": "json_object"}}], ids=["tools", "json_object"])
def test_chat_store_hit_answers_as_the_prefill_path(cluster, extra):
    messages = [{"role": "user", "content": f"review forty chat {sorted(extra)}: add two and three, please " * 2}]
    body = {"max_tokens": 60, "temperature": 0, **extra}
    assert route(chat(cluster.url, messages, max_tokens=1, temperature=0, **extra))["decision"] == "prefill"
    got = chat(cluster.url, messages, **body)
    assert route(got)["decision"] == "store_hit", route(got)
    first = chat(cluster.prefill_urls[0], messages, **{**body, "max_tokens": 1},
                 kv_transfer_params={"do_remote_decode": True})
    want = chat(cluster.decode_urls[0], messages, **body, kv_transfer_params=first["kv_transfer_params"])
    assert without_ids(got["choices"][0]["message"]) == without_ids(want["choices"][0]["message"])
    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
