"""The proxy as a real process in front of real `--role both` tiny-llama nodes, on loopback.

Greedy output through the proxy must equal the same request sent straight to a node (completions
and chat, streaming or not, and through the official openai client); /health, auth, bad input,
a dead decode node are checked on the wire (faults: test_proxy_faults.py).
"""

from __future__ import annotations

import httpx
import pytest

from conftest import free_port
from polling import wait_until
from test_proxy_support import ProxyProcess, proxy_factory, request, sse_payloads  # noqa: F401

PROMPT = "The quick brown fox jumps over the lazy dog and then"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name three colours"}]


@pytest.fixture(scope="module")
def two_nodes(tiny_llama, node_factory):
    return node_factory(tiny_llama), node_factory(tiny_llama)


@pytest.fixture(scope="module")
def proxy(tiny_llama, two_nodes, proxy_factory) -> ProxyProcess:
    a, b = two_nodes
    return proxy_factory(tiny_llama, [a.url, b.url], [b.url, a.url], "--prefill-policy", "prefix_aware",
                         "--decode-policy", "round_robin", "--prefix-chunk-tokens", "4")


def stream_text(payloads: list, chat: bool) -> str:
    if chat:
        return "".join(c["delta"].get("content") or "" for p in payloads for c in p["choices"])
    return "".join(c["text"] for p in payloads for c in p["choices"])


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}),      # answered by prefill
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 9, "temperature": 0}),
])
def test_non_streaming_greedy_output_equals_a_direct_node(proxy, two_nodes, path, body):
    direct = request(two_nodes[0].url, path, body).json()
    for _ in range(2):                                      # round-robin: both decode nodes answer once
        via = request(proxy.url, path, body)
        assert via.status_code == 200, via.text
        got = via.json()
        assert got["choices"] == direct["choices"]
        assert {k: got["usage"][k] for k in ("prompt_tokens", "completion_tokens")} == \
               {k: direct["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
        assert "kv_transfer_params" not in got or got["kv_transfer_params"] is None


@pytest.mark.parametrize("path, body, chat", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}, False),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}, True),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}, False),
])
def test_streaming_passes_every_chunk_and_usage_through(proxy, two_nodes, path, body, chat):
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", two_nodes[1].url + path, json=body, timeout=60) as r:
        direct = sse_payloads(r)
    with httpx.stream("POST", proxy.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        via = sse_payloads(r)
    assert len(via) == len(direct)
    assert stream_text(via, chat) == stream_text(direct, chat)
    assert via[-1]["usage"]["completion_tokens"] == direct[-1]["usage"]["completion_tokens"] == body["max_tokens"]
    assert via[-1]["usage"]["prompt_tokens"] == direct[-1]["usage"]["prompt_tokens"]


def test_openai_client_streams_through_the_proxy(proxy, two_nodes):
    import openai

    direct = request(two_nodes[0].url, "/v1/chat/completions",
                     {"messages": MESSAGES, "max_tokens": 10, "temperature": 0}).json()
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct["choices"][0]["message"]["content"]
    assert chunks[-1].usage.completion_tokens == 10


def test_models_health_and_metrics(proxy, two_nodes):
    """Sends its own completion first: runs alone or in any order (it once relied on earlier tests)."""
    def ok_count(text: str) -> float:
        for line in text.splitlines():
            if line.startswith('pdserve_proxy_requests_total{endpoint="/v1/completions",outcome="ok"}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = ok_count(httpx.get(proxy.url + "/metrics").text)
    assert request(proxy.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    models = httpx.get(proxy.url + "/v1/models").json()
    assert models["data"][0]["id"] == httpx.get(two_nodes[0].url + "/v1/models").json()["data"][0]["id"]
    health = httpx.get(proxy.url + "/health")
    assert health.status_code == 200
    assert sorted(health.json()["decode_healthy"]) == sorted(n.url for n in two_nodes)
    wait_until(lambda: ok_count(httpx.get(proxy.url + "/metrics").text) == before + 1, 10, "ok counted once")
    text = httpx.get(proxy.url + "/metrics").text
    assert f'pdserve_proxy_node_healthy{{node="{two_nodes[0].url}",role="prefill"}} 1.0' in text


@pytest.mark.parametrize("body, status, message", [
    ({"prompt": PROMPT, "temperature": -3}, 400, "temperature"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": PROMPT, "model": "gpt-9"}, 404, "gpt-9"),
    ({"prompt": "word " * 3000, "max_tokens": 4}, 400, "max-model-len"),     # the node's own check
])
def test_bad_input_gets_an_openai_error_body(proxy, body, status, message):
    r = request(proxy.url, "/v1/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_api_key_is_required_on_v1_but_not_on_health(tiny_llama, two_nodes, proxy_factory):
    a, _ = two_nodes
    keyed = proxy_factory(tiny_llama, [a.url], [a.url], "--api-key", "s3cret")
    body = {"prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        r = request(keyed.url, "/v1/completions", body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed.url + "/v1/models").status_code == 401
    assert request(keyed.url, "/v1/completions", body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 200


def test_health_is_503_without_a_healthy_decode_node(tiny_llama, two_nodes, proxy_factory):
    dead = f"http://127.0.0.1:{free_port()}"
    half = proxy_factory(tiny_llama, [two_nodes[0].url], [dead], healthy=False)
    health = httpx.get(half.url + "/health")
    assert health.status_code == 503 and health.json()["decode_healthy"] == []
    r = request(half.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 503 and "no healthy decode node" in r.json()["error"]["message"]
