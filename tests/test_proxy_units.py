"""Proxy pieces without processes: routing policies, node pools, config checks, SSE re-cutting,
request validation and the bodies sent to prefill and decode nodes."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.engine.server.errors import APIError
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.inputs import CHAT, COMPLETIONS, Routing, decode_body, parse_request, prefill_body
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.nodes import Node, RecentKeys
from pdserve.proxy.policies import LeastLoaded, PrefixAware, RoundRobin, make_policy
from pdserve.proxy.router import NodePool, NoHealthyNode
from pdserve.proxy.upstream import sse_events


def nodes(*urls: str) -> list[Node]:
    return [Node(url, "decode", healthy=True) for url in urls]


def test_round_robin_cycles_in_url_order_and_skips_missing_candidates():
    a, b, c = nodes("http://a", "http://b", "http://c")
    rr = RoundRobin()
    assert [rr.choose([c, a, b], []).url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    assert rr.choose([a, c], []).url == "http://c"          # b is out: the next one after a is c
    assert rr.choose([a, c], []).url == "http://a"


def test_least_loaded_orders_by_requests_then_tokens_then_url():
    a, b, c = nodes("http://a", "http://b", "http://c")
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 1
    b.in_flight_tokens, c.in_flight_tokens = 900, 100
    assert LeastLoaded().choose([a, b, c], []).url == "http://c"
    c.in_flight_tokens = 900
    assert LeastLoaded().choose([a, c, b], []).url == "http://b"


def test_prefix_aware_prefers_leading_overlap_then_load():
    a, b = nodes("http://a", "http://b")
    a.recent_keys.add(["k0", "k1"])
    b.recent_keys.add(["k1", "k2", "k3"])                    # more keys, but not the leading chain
    assert PrefixAware().choose([a, b], ["k0", "k1", "k2"]).url == "http://a"
    a.in_flight = 5
    assert PrefixAware().choose([a, b], ["k0"]).url == "http://a"     # overlap beats load
    assert PrefixAware().choose([a, b], ["zz"]).url == "http://b"     # no overlap: least loaded


def test_recent_keys_is_a_bounded_lru():
    keys = RecentKeys(capacity=3)
    keys.add(["a", "b", "c"])
    keys.add(["a"])                     # refresh a: b is now the oldest
    keys.add(["d"])
    assert len(keys) == 3
    assert keys.leading_overlap(["a"]) == 1 and keys.leading_overlap(["b"]) == 0
    assert keys.leading_overlap(["c", "d", "a", "b"]) == 3
    with pytest.raises(ValueError, match="capacity"):
        RecentKeys(0)


def test_make_policy_rejects_unknown_names():
    assert isinstance(make_policy("prefix_aware"), PrefixAware)
    with pytest.raises(ValueError, match="round_robin, least_loaded, prefix_aware"):
        make_policy("random")


def test_pool_choose_skips_unhealthy_and_tried_nodes_and_records_keys():
    pool = NodePool("prefill", ("http://a", "http://b"), "round_robin", ProxyMetrics())
    with pytest.raises(NoHealthyNode, match="no healthy prefill node"):
        pool.choose([])                                      # nothing probed yet
    for node in pool.nodes:
        pool.set_health(node, True)
    first = pool.choose(["k"])
    assert first.recent_keys.leading_overlap(["k"]) == 1
    assert pool.choose([], exclude={first.url}).url != first.url
    pool.mark_failed(pool.nodes[1], "connect refused")
    assert [n.url for n in pool.healthy] == ["http://a"]
    with pytest.raises(NoHealthyNode, match="already tried"):
        pool.choose([], exclude={"http://a"})


def test_pool_leases_count_in_flight_and_release_once():
    metrics = ProxyMetrics()
    pool = NodePool("decode", ("http://a",), "least_loaded", metrics)
    node = pool.nodes[0]
    with pool.lease(node, 10):
        release = pool.acquire(node, 5)
        assert (node.in_flight, node.in_flight_tokens) == (2, 15)
        release()
        release()                                            # idempotent
    assert (node.in_flight, node.in_flight_tokens) == (0, 0)
    gauge = metrics.registry.get_sample_value("pdserve_proxy_node_in_flight",
                                              {"role": "decode", "node": "http://a"})
    assert gauge == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(prefill_urls=()), "need >= 1 prefill"),
    (dict(decode_urls=("127.0.0.1:1",)), "must start with http://"),
    (dict(decode_urls=("http://a", "http://a")), "lists http://a 2 times"),
    (dict(prefill_policy="fastest"), "unknown routing policy 'fastest'"),
    (dict(health_interval_s=0), "--health-interval must be > 0"),
])
def test_config_rejects_bad_values_naming_them(kwargs, message):
    base = dict(prefill_urls=("http://p",), decode_urls=("http://d",), model="m")
    with pytest.raises(ValueError, match=message):
        ProxyConfig(**{**base, **kwargs})


def test_sse_events_recuts_arbitrary_byte_boundaries():
    async def chunks():
        for piece in (b"data: {\"a\"", b": 1}\n", b"\ndata: [DO", b"NE]\n\ndata: tail"):
            yield piece

    async def collect():
        return [e async for e in sse_events(chunks())]

    assert asyncio.run(collect()) == [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n", b"data: tail\n\n"]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from pdserve.engine.text.tokenizer import load_tokenizer

    return load_tokenizer(tiny_llama)


ROUTING = Routing(chunk_tokens=4, salt="proxy:test")


def parse(endpoint: str, body, tokenizer):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return asyncio.run(parse_request(endpoint, raw, tokenizer, ROUTING))


def test_parse_tokenizes_like_the_node_and_builds_prefill_and_decode_bodies(tokenizer):
    from pdserve.engine.text.tokenizer import apply_chat_template

    body = {"model": "m", "prompt": "one two three four five six seven eight nine", "max_tokens": 7,
            "stream": True, "stream_options": {"include_usage": True}, "n": 2, "min_tokens": 3}
    req = parse(COMPLETIONS, body, tokenizer)
    assert req.prompt_ids == tokenizer.encode(body["prompt"])
    assert len(req.chunk_keys) == len(req.prompt_ids) // 4 and req.stream and req.max_tokens == 7
    pre = prefill_body(req, "node-model")
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "stream_options" not in pre
    assert (pre["n"], pre["min_tokens"], pre["model"]) == (1, 1, "node-model")   # min_tokens capped at 1
    assert pre["prompt_token_ids"] == req.prompt_ids
    assert pre["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    dec = decode_body(req, "node-model", [{"chunk_keys": ["x"]}])
    assert dec == {**body, "model": "node-model", "prompt_token_ids": req.prompt_ids,
                   "kv_transfer_params": {"chunk_keys": ["x"]}}
    assert body["max_tokens"] == 7                           # the client's body is not mutated

    messages = [{"role": "user", "content": "hi"}]
    chat = parse(CHAT, {"messages": messages, "max_completion_tokens": 1}, tokenizer)
    assert chat.prompt_ids == apply_chat_template(tokenizer, messages)
    assert chat.prefill_only
    assert prefill_body(chat, None)["max_completion_tokens"] == 1


@pytest.mark.parametrize("endpoint, body, message", [
    (COMPLETIONS, b"{not json", "not valid JSON"),
    (COMPLETIONS, b"[1, 2]", "must be a JSON object"),
    (COMPLETIONS, {"max_tokens": 3}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "temperature": -1}, "temperature"),
    (COMPLETIONS, {"prompt": ["a", ""]}, "the prompt is empty"),
    (COMPLETIONS, {"prompt": "x", "prompt_token_ids": [1]}, "set by the proxy"),
    (COMPLETIONS, {"prompt": "x", "echo": True, "prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20]"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True, "prompt_logprobs": 1},
     "not available when stream"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only 'text' parts"),
])
def test_parse_rejects_bad_input_with_400(tokenizer, endpoint, body, message):
    with pytest.raises(APIError) as info:
        parse(endpoint, body, tokenizer)
    assert info.value.status == 400 and message in info.value.message


# -- every client field reaches the nodes (issue 43) ---------------------------------------------------------------

PROXY_SETS = {"model", "prompt_token_ids", "kv_transfer_params", "cache_salt"}     # the proxy's, in both bodies
PREFILL_SETS = PROXY_SETS | {"max_tokens", "max_completion_tokens", "stream", "stream_options", "n", "min_tokens"}


def _fields(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_the_node_bodies_carry_every_field_the_client_sent(endpoint):
    """Mutation caught (issue 43; before, only the slow P/D parity tests noticed): the proxy dropping ``seed`` from
    the decode body. Every field of the request model, so a field added later cannot be forgotten: each client
    value reaches the decode node as sent, and the prefill node too unless the proxy sets it (``PREFILL_SETS``)."""
    from pdserve.engine.server.protocol import ChatCompletionRequest, CompletionRequest
    from pdserve.proxy.inputs import Prompt, ProxyRequest

    fields = _fields(CompletionRequest if endpoint == COMPLETIONS else ChatCompletionRequest)
    assert {"seed", "temperature", "top_p", "logprobs", "stop", "logit_bias", "min_tokens"} <= fields
    body = {name: f"client's {name}" for name in fields}
    req = ProxyRequest(endpoint, body, [Prompt([5, 6, 7], [])], stream=True, max_tokens=9, min_tokens=3)
    decode, prefill = decode_body(req, "m", [{"k": 1}]), prefill_body(req, "m")
    assert {n for n in fields - PROXY_SETS if decode.get(n) != body[n]} == set()
    assert {n for n in fields - PREFILL_SETS if prefill.get(n) != body[n]} == set()
    assert decode["prompt_token_ids"] == [5, 6, 7] and decode["kv_transfer_params"] == {"k": 1}
