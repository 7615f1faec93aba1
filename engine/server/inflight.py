"""A bound on the requests a node works on at once: beyond it, 503 with ``Retry-After`` at once.

Who calls it: ``build_app`` mounts ``InflightLimit`` (pure ASGI) in front of the generation routes
(``/v1/completions``, ``/v1/chat/completions``). A request counts from the moment its whole body has
arrived (it sits inside ``BodyLimits``: a body that never ends holds a connection, not a slot) until its
response -- streamed or not -- has been sent in full or the client went away. The proxy tries a 503 on another
node (``proxy.orchestrate``), so a node at its limit sheds load instead of queueing without bound.
``--max-inflight-requests`` sets the bound (``rejected`` counts refusals, logged once per burst).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.engine.server.errors import error_response

LIMITED_PATHS = ("/v1/completions", "/v1/chat/completions")
RETRY_AFTER_S = 1


class InflightLimit:
    def __init__(self, app: ASGIApp, max_inflight: int):
        if max_inflight < 1:
            raise ValueError(f"--max-inflight-requests must be >= 1, got {max_inflight}")
        self.app, self.max_inflight = app, max_inflight
        self.inflight = 0
        self.rejected = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in LIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.inflight >= self.max_inflight:
            self.rejected += 1
            response = error_response(503, f"the node is serving {self.inflight} requests; "
                                           f"--max-inflight-requests is {self.max_inflight}; retry later",
                                      code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
            await response(scope, receive, send)
            return
        self.inflight += 1                 # one event loop: no lock needed
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1
