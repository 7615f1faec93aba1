"""``build_app(engine, api_key=...)``: the node's FastAPI app, served by uvicorn from ``pdserve node``.

    engine = AsyncEngine(config)            # pdserve.engine.core.async_engine
    app = build_app(engine, api_key=key, limits=RequestLimits(...))   # routes, errors, metrics, auth, limits
    uvicorn.run(app, host=..., port=...)

Routes: completions.py, chat.py, info.py (models, health, metrics, tokenize). The app holds no
engine lifecycle: whoever built the engine shuts it down.

Every request first passes the node's pure-ASGI front, outermost first: ``BearerAuth`` with ``--api-key``
(every path but /health and /metrics), ``BodyLimits`` (``--max-request-bytes``, JSON nesting),
``InflightLimit`` (``--max-inflight-requests``), then ``DirectRoutes``, which serves the two generation
routes itself when FastAPI would accept the body: the same pydantic models and the same handlers, without
FastAPI's routing, dependency solving and middleware stack on the way in and out (a burst of 32 prompts
reaches the engine that much sooner: the API process is the one that admits them, one at a time).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from pdserve.engine.request_limits import RequestLimits
from pdserve.engine.server import chat, completions, info
from pdserve.engine.server.auth import BearerAuth
from pdserve.engine.server.common import make_node_state
from pdserve.engine.server.direct import DirectRoutes, FrontedApp
from pdserve.engine.server.errors import install_error_handlers
from pdserve.engine.server.inflight import InflightLimit
from pdserve.engine.server.limits import BodyLimits
from pdserve.engine.server.metrics import ServerMetrics
from pdserve.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.engine.server.tools.config import ToolConfig


def build_app(engine, *, api_key: str | tuple[str, ...] | None = None, limits: RequestLimits = RequestLimits(),
              max_inflight: int = 1024, tools: ToolConfig = ToolConfig()) -> FastAPI:
    """``/openapi.json`` describes every route with its bounded request schema (``protocol``); the
    fuzz test reads it. The front, outermost first: the API key, ``BodyLimits``, ``InflightLimit``
    (503 + Retry-After past ``max_inflight`` generation requests whose body has arrived; inside
    ``BodyLimits``: a body still arriving holds a connection, never a slot), ``DirectRoutes``."""
    def front(stack: ASGIApp) -> ASGIApp:
        direct = DirectRoutes(stack, _direct_routes(), lambda: app.exception_handlers)
        outer = BodyLimits(InflightLimit(direct, max_inflight=max_inflight), limits=limits)
        return BearerAuth(outer, api_key) if api_key else outer

    app = FrontedApp(front, title="pdserve node", docs_url=None, redoc_url=None)
    app.state.node = make_node_state(engine, ServerMetrics(engine, engine.model_name), limits, tools)
    install_error_handlers(app)
    for router in (completions.router, chat.router, info.router, info.open_router):
        app.include_router(router)
    return app


def _direct_routes() -> dict[str, tuple[type, Any]]:
    """The generation routes for ``DirectRoutes``: the FastAPI routes' own models and handlers."""
    def serve(handler):
        async def direct(request: Request, parsed, body: dict[str, Any]) -> Response:
            result = await handler(parsed, request)
            return result if isinstance(result, Response) else JSONResponse(result)   # FastAPI's default
        return direct
    return {"/v1/completions": (CompletionRequest, serve(completions.create_completion)),
            "/v1/chat/completions": (ChatCompletionRequest, serve(chat.create_chat_completion))}
