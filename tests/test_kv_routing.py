"""Routing by cache, in one process (issue 40): the kv_aware score, the P/D decision, ``usage.kv_transfer.route``.

The same paths with real nodes, a real store daemon and a restart: ``test_kv_routing_e2e.py``.
"""

from __future__ import annotations

import json
import time

from pdserve.proxy.accounting import event_with_route, json_with_route
from pdserve.proxy.inputs import Prompt, ProxyRequest
from pdserve.proxy.kv_routing import KVRouting
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.nodes import Node
from pdserve.proxy.policies import KVAware, KVHint, kv_cost


def node(url: str, blocks=(), in_flight_tokens: int = 0) -> Node:
    n = Node(url, "decode", healthy=True)
    n.kv.blocks, n.kv.heard = set(blocks), time.monotonic()      # as if its last batch just came
    n.in_flight_tokens = in_flight_tokens
    return n


def test_kv_aware_prefers_the_node_holding_the_prefix_until_its_load_outweighs_it():
    hint = KVHint(num_tokens=64, block_size=4, block_hashes=tuple(range(16)), store_tokens=0)
    warm, cold = node("http://a", range(12)), node("http://b")
    assert kv_cost(warm, hint) == 16 and kv_cost(cold, hint) == 64
    assert KVAware().choose([cold, warm], [], hint).url == "http://a"
    warm.in_flight_tokens = 800                        # 0.05 x 800 = 40 tokens of decode work < 48 saved
    assert KVAware().choose([cold, warm], [], hint).url == "http://a"
    warm.in_flight_tokens = 1000                       # 50 > 48
    assert KVAware().choose([cold, warm], [], hint).url == "http://b"
    warm.role = cold.role = "prefill"                  # queued prompts weigh 0.5 a token: 100 in flight is 50 > 48
    warm.in_flight_tokens = 100
    assert KVAware().choose([cold, warm], [], hint).url == "http://b"
    assert KVAware().choose([warm, cold], [], None).url == "http://b"      # no hint: least loaded


def test_kv_aware_counts_the_store_as_a_cheaper_tier_than_compute():
    hint = KVHint(num_tokens=64, block_size=4, block_hashes=tuple(range(16)), store_tokens=48)
    a, b = node("http://a", range(8)), node("http://b")
    assert kv_cost(a, hint) == 16 + 0.1 * 16 and kv_cost(b, hint) == 16 + 0.1 * 48
    assert KVAware().choose([b, a], [], hint).url == "http://a"


def request(n: int, **body) -> ProxyRequest:
    return ProxyRequest("/v1/completions", body, [Prompt(list(range(n)), [])], stream=False, max_tokens=8)


def test_decision_store_hit_local_threshold_and_prefill():
    kv = KVRouting(ProxyMetrics(), local_prefill_threshold=32)
    kv.block_size = 16
    assert kv._decide(request(100), store=100, local=0) == "store_hit"
    assert kv._decide(request(100), store=96, local=0) == "store_hit"       # all but the last block
    assert kv._decide(request(100), store=80, local=0) == "decode_local"    # 20 uncached < 32
    assert kv._decide(request(100), store=0, local=70) == "decode_local"
    assert kv._decide(request(100), store=0, local=64) == "prefill"         # 36 uncached
    assert kv._decide(request(20), store=0, local=0) == "decode_local"      # a short prompt
    assert kv._decide(request(100, echo=True), store=100, local=0) == "prefill"
    assert kv._decide(request(100, prompt_logprobs=1), store=100, local=0) == "prefill"
    two = ProxyRequest("/v1/completions", {}, [Prompt([1] * 100, []), Prompt([2] * 100, [])], False, 8)
    assert kv._decide(two, store=100, local=0) == "prefill"
    one_token = ProxyRequest("/v1/completions", {}, [Prompt([1] * 100, [])], False, 1)
    assert kv._decide(one_token, store=100, local=0) == "prefill"           # the prefill node's answer is all
    off = KVRouting(ProxyMetrics(), skip_on_store_hit=False)
    off.block_size = 16
    assert off._decide(request(100), store=100, local=0) == "prefill"


def test_route_lands_in_usage_kv_transfer_only_where_there_is_one():
    route = {"decision": "store_hit", "store_hit_tokens": 96, "decode_local_hit_tokens": 0}
    answer = {"usage": {"prompt_tokens": 3, "kv_transfer": {"decode": {"loaded_tokens": 96}}}}
    got = json.loads(json_with_route(json.dumps(answer).encode(), route))
    assert got["usage"]["kv_transfer"] == {"decode": {"loaded_tokens": 96}, "route": route}
    plain = json.dumps({"usage": {"prompt_tokens": 3}}).encode()
    assert json_with_route(plain, route) == plain
    event = b"data: " + json.dumps(answer).encode() + b"\n\n"
    rewritten = event_with_route(route)(event)
    assert json.loads(rewritten[6:])["usage"]["kv_transfer"]["route"] == route and rewritten.endswith(b"\n\n")
    assert event_with_route(route)(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


def test_node_cards_switch_the_routing_keys_to_the_stores_only_when_well_formed():
    from pdserve.kvstore.keys import chunk_keys
    from pdserve.proxy.inputs import Routing

    before = Routing(4, "proxy:m")
    kv = KVRouting(ProxyMetrics(), store_url="tcp://127.0.0.1:1")          # never asked here
    bad = {"kv": {"block_size": 4, "events": None, "store": {"fingerprint": "x", "chunk_tokens": 8, "num_layers": 2}}}
    assert kv.on_card(node("http://a"), bad, before) == before
    fp = "0123456789abcdef" * 2
    good = {"kv": {"block_size": 4, "events": None, "store": {"fingerprint": fp, "chunk_tokens": 8, "num_layers": 2}}}
    routing = kv.on_card(node("http://a"), good, before)
    ids = list(range(21))
    assert routing.keys(ids, "s") == chunk_keys(ids, 8, fp, include_partial=True, cache_salt="s")   # the store's
    assert len(routing.keys(ids, None)) == 3 and routing.block_hashes(ids, None) == ()                # no token
    kv._client.close()
