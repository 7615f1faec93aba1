"""``BearerAuth``: the ``--api-key`` check, outermost in the node's front (``app.build_app``) and the proxy's
(``proxy.app.build_app``). Its own module so that the proxy imports it without the node's app (and torch).

Several keys may be accepted (the proxy's ``--api-key K1 K2 ...``, as vLLM's); the index of the key a request
presented is left in its ASGI scope under ``API_KEY_INDEX`` for the app behind (the proxy derives a tenant's
``cache_salt`` from it, ``proxy.tenants``). The key itself goes no further than this module.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.engine.server.errors import error_response

log = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/health", "/metrics"})
API_KEY_INDEX = "pdserve.api_key_index"      # scope key: which of the accepted keys the request presented


class BearerAuth:
    """Pure ASGI middleware: every path but OPEN_PATHS needs ``Authorization: Bearer <key>`` with one of
    ``api_keys``. Runs before body parsing, so an unauthenticated client learns nothing but 401."""

    def __init__(self, app: ASGIApp, api_keys: str | Sequence[str]):
        keys = [api_keys] if isinstance(api_keys, str) else list(api_keys)
        if not keys or not all(keys):
            raise ValueError(f"--api-key needs non-empty keys, got {len(keys)} key(s) of which "
                             f"{sum(not k for k in keys)} empty")
        self.app = app
        self._expected = [f"Bearer {key}".encode("latin-1") for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        index = self._key_index(scope)
        if index is not None:
            scope[API_KEY_INDEX] = index
            await self.app(scope, receive, send)
            return
        response = error_response(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _key_index(self, scope: Scope) -> int | None:
        """The index of the key presented, or None; every key is compared (no early exit to time)."""
        got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        matches = [hmac.compare_digest(got, expected) for expected in self._expected]
        return matches.index(True) if any(matches) else None


def api_keys_from_args(args, what: str) -> tuple[str, ...]:
    """``--api-key`` values, else PDSERVE_API_KEY's (whitespace-separated): the keys ``pdserve node``, ``proxy``
    and ``serve`` accept. Keys on the command line are visible to every local user (ps): a warning says so."""
    from pdserve.engine import envs

    if args.api_key:
        log.warning("%s: --api-key on the command line is visible to every local user (ps, /proc); prefer "
                    "PDSERVE_API_KEY in the environment", what)
        return tuple(args.api_key)
    return tuple(envs.PDSERVE_API_KEY.split())
