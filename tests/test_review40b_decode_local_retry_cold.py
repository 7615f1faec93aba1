"""Review 40b: ``decode_local`` is decided once, on the predicted (warm) decode node; when that node answers busy
(503) the retry sends the same prompt-only body to a cold decode node, which prefills the whole prompt itself.

proxy/orchestrate.py:104-124 (``_handle``) + :192-215 (``_retrying``): the route is planned once; the decode call's
body is fixed (``kv = [None]``: no prefill, no ``kv_transfer_params``) and ``_retrying`` tries the next node with
``exclude=tried``. kv_routing.plan (proxy/kv_routing.py:143-144) counted only the predicted node's prefix cache --
the node ``KVAware().choose`` picks first. A warm node is the one most likely to be full and answer 503/429 (or 5xx);
the retry then lands on a node holding none of the prompt, still as ``decode_local``: the decode node computes every
prompt token itself, far over ``--local-prefill-threshold`` -- the very case the threshold exists to prevent (a long
prefill inside a decode node's batch), with the prefill pool idle.

Correct: a retry that leaves the node the decision was made for re-decides (or the retry pick is held to nodes for
which the decision holds): the node that finally gets a prompt-only call lacks fewer than the threshold's tokens;
otherwise the request goes through a prefill node first (its decode call carries ``kv_transfer_params``).
Real parts: ``Orchestrator``, ``KVRouting``, ``NodePool("kv_aware")``, ``ConnectionPool`` over HTTP to scripted
nodes (``fake_node.FakeNode``, real uvicorn servers on 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import time

from fake_node import FakeNode, Reply
from pdserve.proxy.http1 import ConnectionPool
from pdserve.proxy.inputs import Prompt, ProxyRequest
from pdserve.proxy.kv_routing import KVRouting
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.orchestrate import Orchestrator
from pdserve.proxy.router import NodePool

THRESHOLD = 32
CMPL = "/v1/completions"


def test_a_busy_warm_node_does_not_send_decode_local_to_a_cold_node():
    prefill_node, warm_node, cold_node = FakeNode(), FakeNode(), FakeNode()
    try:
        metrics = ProxyMetrics()
        kv = KVRouting(metrics, token="r40b" * 12, local_prefill_threshold=THRESHOLD)
        kv.block_size = 4
        prefill = NodePool("prefill", (prefill_node.url,), "kv_aware", metrics)
        decode = NodePool("decode", (warm_node.url, cold_node.url), "kv_aware", metrics)
        for node in prefill.nodes + decode.nodes:
            node.healthy = True
        warm = next(n for n in decode.nodes if n.url == warm_node.url.rstrip("/"))
        blocks = tuple(range(100, 150))                             # 200 tokens in blocks of 4: all on warm
        warm.kv.blocks, warm.kv.heard = set(blocks), time.monotonic()
        warm_node.script(CMPL, Reply(status=503, headers={"Retry-After": "1"}))     # warm is full
        prefilled = {"id": "fake-1", "object": "text_completion", "created": 0, "model": "llama",
                     "choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None}],
                     "usage": {"prompt_tokens": 200, "completion_tokens": 1, "total_tokens": 201},
                     "kv_transfer_params": {"do_remote_prefill": True, "request_id": "fake-prefill-1"}}
        prefill_node.script(CMPL, Reply(body=prefilled))          # the prefill path's answer, should it be asked
        req = ProxyRequest(CMPL, {"prompt": "x", "max_tokens": 4}, [Prompt(list(range(200)), [], blocks)],
                           False, 4)

        async def main():
            client = ConnectionPool(8, 5.0, 30.0)
            orch = Orchestrator(client, prefill, decode, metrics, max_attempts=3, model_name=lambda: "llama", kv=kv)
            response = await orch.handle(req, lambda outcome: None)
            await kv.stop()
            return response

        response = asyncio.run(main())
        assert response.status_code == 200, response.body
        assert len(warm_node.posts(CMPL)) == 1, "precondition: the warm node was tried first and answered 503"
        cold_calls = cold_node.posts(CMPL)
        assert len(cold_calls) == 1, "precondition: the retry went to the cold node"
        cold = next(n for n in decode.nodes if n.url == cold_node.url.rstrip("/"))
        lacking = 200 - cold.kv.leading_blocks(list(blocks)) * kv.block_size
        assert cold_calls[0].get("kv_transfer_params") is not None or lacking < THRESHOLD, \
            f"decode_local retried on the cold node: it prefills {lacking} prompt tokens itself (threshold " \
            f"{THRESHOLD}); prefill node calls: {len(prefill_node.posts(CMPL))}"
    finally:
        for node in (prefill_node, warm_node, cold_node):
            node.stop()
