"""Review 40b: ``prompt_logprobs: false`` asks the node for prompt logprobs (pydantic reads false as 0), but the
proxy's ``_asked`` takes it for "not asked" and skips the prefill node -- the sibling of review 40's
``prompt_logprobs: 0``.

proxy/kv_routing.py:253-256 (``_asked``): ``value is not None and value is not False``. The node's body model
(engine/server/protocol.py:176, ``prompt_logprobs: Count | None``, validated in pydantic's lax mode by
engine/server/direct.py:89 ``model_validate``) turns ``false`` into 0, and ``to_sampling_params`` passes
``prompt_logprobs=0``: the node computes each prompt token's logprob. A request computing prompt logprobs never
loads from the store (engine/kv/kv_connector.py:140), so a stored or decode-cached prompt routed ``store_hit`` /
``decode_local`` is prefilled in full by the decode node -- what NO_SKIP_FIELDS exists to prevent (the module
docstring: "prompt logprobs: prefill").

Correct: the proxy decides "asked" as the node will -- any value the node reads as a count (false as 0) keeps the
request on the prefill path. (The reverse, ``echo: 0`` / ``"false"`` read by the node as false but "asked" by the
proxy, only costs a needless prefill.)
Real parts: the node's own request model, ``KVRouting.plan``, ``NodePool("kv_aware")``.
"""

from __future__ import annotations

import asyncio
import time

from pdserve.engine.server.protocol import CompletionRequest
from pdserve.proxy.inputs import Prompt, ProxyRequest
from pdserve.proxy.kv_routing import KVRouting
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.router import NodePool

THRESHOLD = 32


def test_prompt_logprobs_false_routes_like_zero():
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "prompt_logprobs": False}
    params = CompletionRequest.model_validate(body).to_sampling_params(2, None)
    assert params.prompt_logprobs == 0, "precondition: the node computes prompt logprobs for false (as for 0)"

    metrics = ProxyMetrics()
    kv = KVRouting(metrics, token="r40b" * 12, local_prefill_threshold=THRESHOLD)
    kv.block_size = 4
    pool = NodePool("decode", ("http://warm",), "kv_aware", metrics)
    warm = pool.nodes[0]
    warm.healthy = True
    blocks = tuple(range(100, 150))                                   # the decode node holds all 200 tokens
    warm.kv.blocks, warm.kv.heard = set(blocks), time.monotonic()

    def decision(fields: dict) -> str:
        req = ProxyRequest("/v1/completions", {**body, **fields}, [Prompt(list(range(200)), [], blocks)], False, 2)
        return asyncio.run(kv.plan(req, pool.healthy, pool.picks_by_cache)).decision

    assert decision({"prompt_logprobs": None}) == "decode_local", "precondition: without prompt logprobs it skips"
    assert decision({"prompt_logprobs": 0}) == "prefill"
    assert decision({"prompt_logprobs": False}) == "prefill", \
        "prompt_logprobs false (the node computes them, as for 0) was routed to the decode node alone"
