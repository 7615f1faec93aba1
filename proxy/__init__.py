"""pdserve.proxy — the public OpenAI-compatible router in front of prefill and decode nodes.

Who calls it: ``pdserve proxy`` (``cli.register``, wired into ``pdserve.engine.cli``) and
``pdserve serve``, which starts it after the nodes. Clients talk to it exactly as to one
OpenAI server: /v1/completions, /v1/chat/completions (SSE streaming, usage), /v1/models,
/health (200 only while >= 1 prefill and >= 1 decode node are healthy), /metrics.

P->D protocol, per client request (``orchestrate``):

    client ──> proxy: validate like a node (the same 4xx body), tokenize once -> prompt_token_ids, routing keys
      (1) POST <same endpoint> to a prefill node:
            client body + max_tokens=1, stream=false, prompt_token_ids,
            kv_transfer_params={"do_remote_decode": true, "do_remote_prefill": false}
          <── a normal completion + top-level "kv_transfer_params" (opaque here; null if absent)
      (2) POST <same endpoint> to a decode node:
            client body + prompt_token_ids + kv_transfer_params=<what (1) returned>
          <── JSON or SSE (one token per event, usage, [DONE]) passed through unchanged;
              the decode node emits the first token itself.
    A non-streaming request with max_tokens == 1 is answered from (1). With routing by cache (``kv_routing``) a
    prompt the store holds, or whose uncached part is under ``--local-prefill-threshold``, skips (1).
    Both calls carry the request's ``cache_salt`` (the client's, or with ``--cache-salt-from-api-key`` its
    tenant's, ``tenants``); ``usage.kv_transfer`` leaves only with ``--expose-kv-accounting`` (``accounting``).

Modules: ``config`` (ProxyConfig), ``nodes`` + ``router`` (node pools, in-flight leases),
``policies`` (round_robin, least_loaded, prefix_aware, kv_aware), ``kv_routing`` (routing by cache: one store lookup
per request, the P/D decision -- prefill, store_hit, decode_local -- docs/routing.md), ``kv_events`` + ``kv_state``
(the nodes' KV events: what each node's prefix cache holds), ``health`` (periodic /health probes on their
own connections; a node they take out has its silent calls in flight failed), ``inputs`` (the nodes' validation and limits, tokenization, downstream bodies),
``http1`` (the HTTP/1.1 client of node calls: asyncio protocols and httptools' parser, kept-alive
connection pools, failure kinds),
``upstream`` (one node call and how it failed: unreachable, 5xx, busy 429/503, an error streamed
before the first token, the node taken out of rotation, or the client's fault), ``orchestrate`` (the two
phases, retries on another node before the first byte, SSE relay that ends a broken stream with an error
event), ``metrics``, ``tenants`` (per-API-key cache salts), ``accounting`` (``usage.kv_transfer`` out of answers),
``app`` (FastAPI, with ``engine.server.direct``: the two POST routes served in front of FastAPI for
bodies it would accept, as the node does), ``cli``. What the proxy adds to a request's latency: ``devbench/proxy_overhead.py``.
"""
