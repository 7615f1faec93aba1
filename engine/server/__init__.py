"""The node's OpenAI-compatible HTTP server (FastAPI), over ``pdserve.engine.core.async_engine.AsyncEngine``.

``pdserve node`` calls ``build_app(engine, api_key=..., limits=...)`` and runs it with uvicorn; the proxy
reuses ``protocol``, ``checks``, ``limits``, ``prompt_work``, ``direct`` and ``errors``, so both refuse alike.

    app.py          build_app: routers, error handlers, per-app metrics registry, body limits
    auth.py         BearerAuth (--api-key), node and proxy
    protocol.py     pydantic request bodies (OpenAI fields + vLLM extras), every field bounded -> SamplingParams
    checks.py       the checks after parsing (vocabulary, choices, prompt characters and tokens), node and proxy
    structured.py   response_format / structured_outputs / guided_* -> StructuredOutputs; xgrammar parses it in a
                    worker thread (a bad schema, regex or grammar: 400 naming the field), node and proxy
    direct.py       DirectRoutes / FrontedApp: the two POST routes served ahead of FastAPI's stack (node and proxy)
    limits.py       BodyLimits: --max-request-bytes and JSON nesting, before the body is parsed
    prompt_work.py  tokenization and chat templating: character limit, short requests on the event loop, worker
                    threads, --tokenize-timeout
    errors.py       the one OpenAI error body; validation / bad JSON / bad params -> 400
    common.py       node state, engine calls, usage, SSE
    generation.py   runs prompts x n engine requests; aborts them when the client goes away
    completions.py  POST /v1/completions
    echo.py         echo and prompt_logprobs in answers (completions and chat), vLLM's shapes
    chat.py         POST /v1/chat/completions (chat template)
    info.py         GET /v1/models, /health, /metrics; POST /tokenize, /detokenize
    metrics.py      Prometheus under vLLM's names (vllm:*; lmcache:* for KV load / publish times): the registry
    metrics_engine.py  what /metrics reads from engine.stats() at scrape time (running, KV usage, prefix cache,
                    preemptions, tokens per step, KV accounting, store tiers)
    request_metrics.py RequestTracker: one engine request's TTFT / ITL, then the core's RequestTimes -> queue /
                    prefill / decode / inference, KV load / publish histograms
    request_trace.py   tracing on: one engine request's spans (llm_request > queue, kv_load, prefill, decode,
                    kv_publish) from the core's times, under the proxy's traceparent
"""

from __future__ import annotations

__all__ = ["build_app"]


def __getattr__(name: str):
    # Lazy: the proxy imports protocol, checks, direct ... from here without the node's app (and torch).
    if name == "build_app":
        from pdserve.engine.server.app import build_app
        return build_app
    raise AttributeError(name)
