"""The proxy's FastAPI app: the public OpenAI API in front of the prefill and decode pools.

Built by ``cli.run_proxy`` (or a test) with ``build_app(config, tokenizer)`` and served by uvicorn.
Routes: POST /v1/completions and /v1/chat/completions (the body parsed into the nodes' own pydantic
models, ``inputs.admit_request``, then ``Orchestrator.handle``), GET /v1/models, /health (200 only while
>= 1 prefill and >= 1 decode node are healthy), /metrics, /openapi.json. Every request first passes the
proxy's own pure-ASGI front, outermost first: ``BearerAuth`` with ``--api-key`` (every path but /health and
/metrics; with ``--cache-salt-from-api-key`` the key a request presented picks its tenant's ``cache_salt``,
``tenants``), then ``BodyLimits`` (``--max-request-bytes``, JSON nesting) -- the node's own middleware --, then
``DirectRoutes``, which serves the two POST routes itself when FastAPI would accept the body (``direct``).
The front sits outside FastAPI's middleware stack (``FrontedApp``): a generation request never passes
Starlette's and FastAPI's layers on its way in or its answer's way out. The lifespan owns the pool of
node connections (``http1.ConnectionPool``, ``--max-node-connections``) and the prober, which has its own;
a node the prober takes out of rotation goes to ``Orchestrator.abort_calls`` (its calls in flight fail); each
node card it reads goes to ``kv_routing`` (KV events, the store's key space: the gate's routing keys change).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp

from pdserve.engine import tracing
from pdserve.engine.server.auth import API_KEY_INDEX, BearerAuth
from pdserve.engine.server.direct import DirectRoutes, FrontedApp
from pdserve.engine.server.errors import APIError, error_response, install_error_handlers
from pdserve.engine.server.limits import BodyLimits
from pdserve.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.health import HealthChecker
from pdserve.proxy.http1 import ConnectionPool
from pdserve.proxy.inputs import CHAT, COMPLETIONS, Gate, Routing, admit_request
from pdserve.proxy.kv_routing import KVRouting
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.orchestrate import Orchestrator
from pdserve.proxy.router import NodePool
from pdserve.proxy.tenants import TenantSalts, load_secret


class ClientGone(Exception):
    """The client disconnected before its response started."""


class ProxyState:
    """Everything one running proxy holds; created by ``build_app``, started by its lifespan."""

    def __init__(self, config: ProxyConfig, tokenizer):
        self.config, self.tokenizer, self.metrics = config, tokenizer, ProxyMetrics()
        self.prefill = NodePool("prefill", config.prefill_urls, config.prefill_policy, self.metrics)
        self.decode = NodePool("decode", config.decode_urls, config.decode_policy, self.metrics)
        self.client = ConnectionPool(config.max_node_connections, config.connect_timeout_s, config.request_timeout_s,
                                     bearer=config.node_api_key)
        self.kv = KVRouting(self.metrics, config.kv_store, config.kv_auth_token, config.local_prefill_threshold,
                            config.skip_prefill_on_store_hit, redis_prefix=config.kv_redis_prefix)
        self.orchestrator = Orchestrator(self.client, self.prefill, self.decode, self.metrics, config.max_attempts,
                                         lambda: self.health.model_name, math.ceil(config.health_interval_s),
                                         config.expose_kv_accounting, self.kv)
        self.health = HealthChecker([self.prefill, self.decode], config.health_interval_s, config.probe_timeout_s,
                                    on_down=self.orchestrator.abort_calls, node_api_key=config.node_api_key,
                                    on_card=self._on_card)
        self.tenants = TenantSalts(config.api_keys, load_secret(config.cache_salt_secret_file)) \
            if config.cache_salt_from_api_key else None
        self.gate = Gate.build(tokenizer, Routing(config.prefix_chunk_tokens, f"proxy:{Path(config.model).name}"),
                               config.limits, lambda: self.health.max_model_len, _model_vocab_size(config.model),
                               config.tools)

    def _on_card(self, node, card: dict) -> None:
        """A node's /v1/models: its KV events and the store's key space (``kv_routing``) may change the routing keys."""
        routing = self.kv.on_card(node, card, self.gate.routing)
        if routing != self.gate.routing:
            self.gate = dataclasses.replace(self.gate, routing=routing)

    @property
    def model_name(self) -> str:
        """The name clients use: --served-model-name, else the nodes' model, else the model dir's name."""
        return self.config.served_model_name or self.health.model_name or Path(self.config.model).name

    @property
    def ready(self) -> bool:
        return bool(self.prefill.healthy) and bool(self.decode.healthy)


def build_app(config: ProxyConfig, tokenizer) -> FastAPI:
    state = ProxyState(config, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.health.probe_all()
        state.health.start()
        try:
            yield
        finally:
            await state.health.stop()
            await state.kv.stop()
            await state.client.aclose()
            state.gate.prompts.shutdown()

    def front(inner: ASGIApp) -> ASGIApp:
        outer = BodyLimits(DirectRoutes(inner, _direct_routes(state), lambda: app.exception_handlers), config.limits)
        return BearerAuth(outer, config.api_keys) if config.api_keys else outer

    app = FrontedApp(front, title="pdserve proxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.proxy = state
    install_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ProxyState) -> None:
    @app.post(COMPLETIONS)          # valid JSON bodies are served by ``DirectRoutes``; these answer the rest
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _serve(state, request, COMPLETIONS, body, await request.json())   # json: FastAPI's, cached

    @app.post(CHAT)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await _serve(state, request, CHAT, body, await request.json())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "root": state.config.model}]}

    @app.get("/health")
    async def health() -> Response:
        body = {"prefill_healthy": [n.url for n in state.prefill.healthy],
                "decode_healthy": [n.url for n in state.decode.healthy]}
        return JSONResponse(body, status_code=200 if state.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)


def _direct_routes(state: ProxyState) -> dict[str, tuple[type, Any]]:
    """The generation routes for ``DirectRoutes``: the same models and ``_serve`` as the FastAPI routes."""
    def serve(endpoint: str):
        return lambda request, parsed, body: _serve(state, request, endpoint, parsed, body)
    return {COMPLETIONS: (CompletionRequest, serve(COMPLETIONS)), CHAT: (ChatCompletionRequest, serve(CHAT))}


def _trace_parent(state: ProxyState, request: Request):
    """The client's trace context, or (``--no-trust-traceparent``) an empty one: the request's trace starts here."""
    return tracing.extract(request.headers if state.config.trust_traceparent else {})


async def _serve(state: ProxyState, request: Request, endpoint: str, parsed, body: dict[str, Any]) -> Response:
    """``parsed``: ``body`` (the client's JSON object) as the endpoint's pydantic model."""
    start = time.perf_counter()
    span = tracing.start_span(f"POST {endpoint}", "server", _trace_parent(state, request),
                              attributes={"http.route": endpoint}) if tracing.enabled() else None

    def on_end(outcome: str) -> None:
        state.metrics.requests.labels(endpoint, outcome).inc()
        state.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        tracing.end(span, attributes={"pdserve.outcome": outcome}, error=None if outcome == "ok" else outcome)

    try:
        _check_model(state, parsed.model)
        req = await admit_request(endpoint, body, parsed, state.gate, cache_salt=_cache_salt(state, request, parsed))
    except APIError:
        on_end("client_error")
        raise
    try:
        with tracing.use(span):                 # the node calls' traceparent: a child of this request's span
            return await _unless_disconnected(request, state.orchestrator.handle(req, on_end))
    except ClientGone:
        on_end("aborted")
        return error_response(499, "client closed the request")


def _cache_salt(state: ProxyState, request: Request, parsed) -> str | None:
    """The salt the nodes get: the tenant's (mixed with the client's) or, without tenants, the client's."""
    if state.tenants is None:
        return parsed.cache_salt
    return state.tenants.salt(request.scope.get(API_KEY_INDEX), parsed.cache_salt)


def _check_model(state: ProxyState, model: Any) -> None:
    served = {state.model_name, state.health.model_name}
    if model is not None and model not in served:
        raise APIError(404, f"model {model!r} does not exist; this proxy serves {state.model_name!r}",
                       param="model", code="model_not_found")


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``; if the client disconnects first, cancel it (closing its node calls) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))

    def on_watch_done(w: asyncio.Future) -> None:
        if not w.cancelled() and w.exception() is None:      # the client left (a failed watch leaves the work be)
            task.cancel()

    watch.add_done_callback(on_watch_done)
    try:
        return await task                   # returns once ``task`` is done, its clean-up included
    except asyncio.CancelledError:
        left = watch.done() and not watch.cancelled() and watch.exception() is None
        if left and not _cancelling(asyncio.current_task()):       # this task's own cancel goes on up
            raise ClientGone() from None
        raise
    finally:
        watch.cancel()                      # nothing to clean up in it: no need to wait for it


def _cancelling(task: asyncio.Task | None) -> int:
    """Cancel requests pending on ``task`` (Python 3.11+; 0 before, where it cannot be told)."""
    return task.cancelling() if task is not None and hasattr(task, "cancelling") else 0


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _model_vocab_size(model_dir: str) -> int | None:
    """The model's ``vocab_size`` from its config.json (the proxy has no weights); None without one."""
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
