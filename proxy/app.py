"""The proxy's FastAPI app: the public OpenAI API in front of the prefill and decode pools.

Built by ``cli.run_proxy`` (or a test) with ``build_app(config, tokenizer)`` and served by uvicorn.
Routes: POST /v1/completions and /v1/chat/completions (``inputs.parse_request`` then
``Orchestrator.handle``), GET /v1/models, /health (200 only while >= 1 prefill and >= 1 decode
node are healthy), /metrics. With ``--api-key`` the /v1 routes want ``Authorization: Bearer``;
/health and /metrics stay open. The lifespan owns the one pooled httpx client and the prober.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Awaitable

import anyio
import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.engine.server.errors import APIError, error_response, install_error_handlers
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.health import HealthChecker
from pdserve.proxy.inputs import CHAT, COMPLETIONS, Routing, parse_request
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.orchestrate import Orchestrator
from pdserve.proxy.router import NodePool


class ClientGone(Exception):
    """The client disconnected before its response started."""


class ProxyState:
    """Everything one running proxy holds; created by ``build_app``, started by its lifespan."""

    def __init__(self, config: ProxyConfig, tokenizer):
        self.config, self.tokenizer, self.metrics = config, tokenizer, ProxyMetrics()
        self.prefill = NodePool("prefill", config.prefill_urls, config.prefill_policy, self.metrics)
        self.decode = NodePool("decode", config.decode_urls, config.decode_policy, self.metrics)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        self.health = HealthChecker([self.prefill, self.decode], self.client,
                                    config.health_interval_s, config.probe_timeout_s)
        self.orchestrator = Orchestrator(self.client, self.prefill, self.decode, self.metrics,
                                         config.max_attempts, lambda: self.health.model_name)
        self.routing = Routing(config.prefix_chunk_tokens, f"proxy:{Path(config.model).name}")

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
            await state.client.aclose()

    app = FastAPI(title="pdserve proxy", lifespan=lifespan)
    app.state.proxy = state
    install_error_handlers(app)
    _add_routes(app, state, _auth_dependency(config.api_key))
    return app


def _add_routes(app: FastAPI, state: ProxyState, auth) -> None:
    @app.post(COMPLETIONS, dependencies=[auth])
    async def completions(request: Request) -> Response:
        return await _serve(state, request, COMPLETIONS)

    @app.post(CHAT, dependencies=[auth])
    async def chat(request: Request) -> Response:
        return await _serve(state, request, CHAT)

    @app.get("/v1/models", dependencies=[auth])
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


async def _serve(state: ProxyState, request: Request, endpoint: str) -> Response:
    start = time.perf_counter()

    def on_end(outcome: str) -> None:
        state.metrics.requests.labels(endpoint, outcome).inc()
        state.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    try:
        req = await parse_request(endpoint, await request.body(), state.tokenizer, state.routing)
        _check_model(state, req.body.get("model"))
    except APIError:
        on_end("client_error")
        raise
    try:
        return await _unless_disconnected(request, state.orchestrator.handle(req, on_end))
    except ClientGone:
        on_end("aborted")
        return error_response(499, "client closed the request")


def _check_model(state: ProxyState, model: Any) -> None:
    served = {state.model_name, state.health.model_name}
    if model is not None and model not in served:
        raise APIError(404, f"model {model!r} does not exist; this proxy serves {state.model_name!r}",
                       param="model", code="model_not_found")


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``; if the client disconnects first, cancel it (closing its node calls) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, watch, return_exceptions=True)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _auth_dependency(api_key: str | None):
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <--api-key>'",
                           code="invalid_api_key")

    return Depends(check)
