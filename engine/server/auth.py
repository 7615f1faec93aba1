"""``BearerAuth``: the ``--api-key`` check, outermost in the node's front (``app.build_app``) and the proxy's
(``proxy.app.build_app``). Its own module so that the proxy imports it without the node's app (and torch)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.engine.server.errors import error_response

OPEN_PATHS = frozenset({"/health", "/metrics"})


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
