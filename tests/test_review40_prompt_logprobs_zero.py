"""Review 40: ``prompt_logprobs: 0`` is taken for "no prompt logprobs" by the P/D decision, and skips the prefill node.

proxy/kv_routing.py:144 (``_decide``) keeps a request on the prefill path when ``any(req.body.get(f) for f in
NO_SKIP_FIELDS)`` -- a truth test, so ``prompt_logprobs: 0`` (valid: each prompt token's own logprob, vLLM's and
pdserve's meaning, engine/server/protocol.py:235) passes as "none". A stored prompt asked with it is routed
``store_hit`` (a short one ``decode_local``): the decode node gets it, and since a request computing prompt
logprobs never loads from the store (engine/kv/kv_connector.py:140, ``computes_prompt_logprobs``) it runs the
whole prefill itself, while the route claims the store's tokens -- the very case NO_SKIP_FIELDS exists for
("the prefill node computes the prompt's logprobs"; the module docstring: "prompt logprobs: prefill").

Correct: ``prompt_logprobs`` of 0 routes like 1 (to the prefill node): decision ``prefill``.
"""

from __future__ import annotations

import pytest

from pdserve.proxy.cluster import ClusterSpec, LocalCluster
from test_kv_routing_e2e import NODE_FLAGS, THRESHOLD, complete, route


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    spec = ClusterSpec(prefill=1, decode=1, kv_routing=True, node_flags=NODE_FLAGS,
                       proxy_flags=("--routing-policy", "kv_aware", "--local-prefill-threshold", str(THRESHOLD)))
    with LocalCluster(str(tiny_llama), spec) as c:
        yield c


def test_prompt_logprobs_zero_is_not_skipped_to_the_decode_node(cluster):
    prompt = "review forty: prompt logprobs zero still asks for the prompt's logprobs " * 2
    assert route(complete(cluster.url, prompt, max_tokens=1, temperature=0))["decision"] == "prefill"   # stored
    one = complete(cluster.url, prompt, max_tokens=2, temperature=0, prompt_logprobs=1)
    assert route(one)["decision"] == "prefill"
    zero = complete(cluster.url, prompt, max_tokens=2, temperature=0, prompt_logprobs=0)
    assert zero["choices"][0].get("prompt_logprobs"), "prompt_logprobs 0 returns the prompt tokens' logprobs"
    decode = zero["usage"]["kv_transfer"].get("decode", {})
    assert route(zero)["decision"] == "prefill", (route(zero), decode)
