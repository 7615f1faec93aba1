"""``build_app(engine, api_key=...)``: the node's FastAPI app, served by uvicorn from ``pdserve node``.

    engine = AsyncEngine(config)            # pdserve.engine.async_engine
    app = build_app(engine, api_key=key, limits=RequestLimits(...))   # routes, errors, metrics, auth, limits
    uvicorn.run(app, host=..., port=...)

Routes: completions.py, chat.py, info.py (models, health, metrics, tokenize). The app holds no
engine lifecycle: whoever built the engine shuts it down.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.engine.request_limits import RequestLimits
from pdserve.engine.server import chat, completions, info
from pdserve.engine.server.common import make_node_state
from pdserve.engine.server.errors import error_response, install_error_handlers
from pdserve.engine.server.inflight import InflightLimit
from pdserve.engine.server.limits import BodyLimits
from pdserve.engine.server.metrics import ServerMetrics

OPEN_PATHS = frozenset({"/health", "/metrics"})


def build_app(engine, *, api_key: str | None = None, limits: RequestLimits = RequestLimits(),
              max_inflight: int = 1024) -> FastAPI:
    """``/openapi.json`` describes every route with its bounded request schema (``protocol``); the
    fuzz test reads it. Middleware, outermost first: the API key, ``BodyLimits``, then ``InflightLimit``
    (503 + Retry-After past ``max_inflight`` generation requests whose body has arrived)."""
    app = FastAPI(title="pdserve node", docs_url=None, redoc_url=None)
    app.state.node = make_node_state(engine, ServerMetrics(engine, engine.model_name), limits)
    install_error_handlers(app)
    for router in (completions.router, chat.router, info.router, info.open_router):
        app.include_router(router)
    app.add_middleware(InflightLimit, max_inflight=max_inflight)   # inside BodyLimits: a body still arriving
    app.add_middleware(BodyLimits, limits=limits)                  # holds a connection, never a slot
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    return app


class BearerAuth:
    """Pure ASGI middleware: every path but OPEN_PATHS needs ``Authorization: Bearer <key>``.
    Runs before body parsing, so an unauthenticated client learns nothing but 401."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(got, self._expected)
