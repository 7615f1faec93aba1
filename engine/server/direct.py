"""The two generation routes served straight from ASGI, in front of FastAPI, for requests FastAPI would accept.

Used by the node (``engine.server.app.build_app``) and the proxy (``proxy.app.build_app``), each as the
innermost layer of a pure-ASGI front that sits outside all of FastAPI's middleware stack (``FrontedApp``):

    app = FrontedApp(lambda stack: BodyLimits(DirectRoutes(stack, routes, lambda: app.exception_handlers)))
    routes = {"/v1/completions": (CompletionRequest, serve), ...}      # serve(request, parsed, body) -> Response

A POST to one of the routes with a ``Content-Type: application/json`` body that parses and validates
against the route's pydantic model goes to ``serve(request, parsed, body)`` here; its exceptions go to the
FastAPI app's own exception handlers (an unexpected one to its ``Exception`` handler: logged, answered 500),
so an error answer is the one FastAPI would give. Every other request
-- another path or method, another content type, a body that is not JSON or does not validate -- goes to
the FastAPI app unchanged (its body replayed), which answers it exactly as before. The same models, the same
``serve``: what changes is only the work skipped on the way in and out, FastAPI's routing, dependency solving
and middleware stack (``devbench/proxy_overhead.py`` measures what the proxy adds).
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.engine.server.limits import replay_body

Serve = Callable[[Request, Any, dict[str, Any]], Awaitable[Response]]


class FrontedApp(FastAPI):
    """FastAPI whose whole middleware stack sits behind ``front`` (a pure-ASGI wrapper, built once)."""

    def __init__(self, front: Callable[[ASGIApp], ASGIApp], **kwargs: Any):
        super().__init__(**kwargs)
        self._front = front

    def build_middleware_stack(self) -> ASGIApp:
        return self._front(super().build_middleware_stack())


class DirectRoutes:
    def __init__(self, app: ASGIApp, routes: dict[str, tuple[type[BaseModel], Serve]],
                 handlers: Callable[[], dict[Any, Callable]]):
        self.app, self._routes, self._handlers = app, routes, handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or not _json_content(scope):
            await self.app(scope, receive, send)
            return
        raw = await _body(receive)
        if raw is None:                                      # the client left before its body was in
            return
        parsed, body = _parse(route[0], raw)
        if parsed is None:                                   # FastAPI's own 400, word for word
            await self.app(scope, replay_body(raw, receive), send)
            return
        request = Request(scope, receive)
        try:
            response = await route[1](request, parsed, body)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:           # no handler at all: uvicorn logs it and answers 500
                raise
            response = await handler(request, exc)
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Callable | None:
        """The app's handler for ``exc`` as Starlette looks it up: the most specific class first, down to
        ``Exception`` (which Starlette's ServerErrorMiddleware would have called: we are outside it)."""
        handlers = self._handlers()
        return next((handlers[cls] for cls in type(exc).__mro__ if cls in handlers), None)


def _json_content(scope: Scope) -> bool:
    content_type = next((v for k, v in scope["headers"] if k == b"content-type"), None)
    return content_type is not None and content_type.split(b";", 1)[0].strip().lower() == b"application/json"


def _parse(model: type[BaseModel], raw: bytes) -> tuple[Any, dict[str, Any]] | tuple[None, None]:
    try:
        body = json.loads(raw)
        if isinstance(body, dict):
            return model.model_validate(body), body
    except (ValueError, RecursionError, ValidationError):
        pass
    return None, None


async def _body(receive: Receive) -> bytes | None:
    """The whole body (``BodyLimits`` hands it on as one message); None if the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
