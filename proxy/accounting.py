"""What the proxy keeps out of public answers: the nodes' ``usage.kv_transfer`` unless ``--expose-kv-accounting``.

Called by ``orchestrate`` on every answer it returns when the flag is off (``pdserve proxy``'s default;
``pdserve serve`` turns it on): the prefill-only answer (a dict), the decode node's JSON answer (bytes) and
each SSE event of its stream (bytes). ``usage.kv_transfer`` holds each node's figures for the request --
``local_hit_tokens``, ``store_hit_tokens``, ``need_to_load``, ``loaded_tokens``, ``recomputed_tokens`` --
which tell what the prefix cache and the KV store already held. When shown, the proxy adds ``route`` to it
(``set_route``, ``json_with_route``, ``event_with_route``): its P/D decision and what the store and the decode node's
prefix cache held at routing (``kv_routing.Route.describe``). ``usage.prompt_tokens_details.cached_tokens``
(an OpenAI field) stays. Bytes without ``"kv_transfer"`` in them pass unchanged, not parsed.
"""

from __future__ import annotations

import json
from typing import Any, Callable

_MARK = b'"kv_transfer"'
_DATA = b"data:"


def drop_kv_accounting(payload: Any) -> bool:
    """Remove ``usage.kv_transfer`` from a parsed answer or chunk, in place; True if there was one."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    return isinstance(usage, dict) and usage.pop("kv_transfer", None) is not None


def json_without_kv_accounting(content: bytes) -> bytes:
    """A node's JSON answer without ``usage.kv_transfer`` (encoded as the node's JSONResponse does)."""
    return _rewrite_json(content, drop_kv_accounting)


def _rewrite_json(content: bytes, edit: Callable[[Any], bool]) -> bytes:
    """A node's JSON answer edited in place by ``edit`` (-> whether it changed anything), re-encoded as the node's
    JSONResponse does; one without ``usage.kv_transfer`` passes unchanged, not parsed."""
    if _MARK not in content:
        return content
    payload = json.loads(content)
    if not edit(payload):
        return content
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def event_without_kv_accounting(event: bytes) -> bytes:
    """One SSE event (``data: {...}\\n\\n``) without ``usage.kv_transfer`` (encoded as the node's ``sse``)."""
    return _rewrite_event(event, drop_kv_accounting)


def _rewrite_event(event: bytes, edit: Callable[[Any], bool]) -> bytes:
    """``event`` with its JSON payload edited in place by ``edit`` (-> whether it changed anything); an event without
    ``usage.kv_transfer``, or one that is not a JSON data line, passes unchanged."""
    if _MARK not in event or not event.startswith(_DATA):
        return event
    try:
        payload = json.loads(event[len(_DATA):])
    except ValueError:
        return event
    if not edit(payload):
        return event
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def set_route(payload: Any, route: dict) -> bool:
    """Add ``route`` as ``usage.kv_transfer.route`` of a parsed answer or chunk that has ``usage.kv_transfer``."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    block = usage.get("kv_transfer") if isinstance(usage, dict) else None
    if not isinstance(block, dict):
        return False
    block["route"] = route
    return True


def json_with_route(content: bytes, route: dict) -> bytes:
    """A node's JSON answer with ``usage.kv_transfer.route`` added (when it has ``usage.kv_transfer``)."""
    return _rewrite_json(content, lambda payload: set_route(payload, route))


def event_with_route(route: dict) -> Callable[[bytes], bytes]:
    """A rewriter of SSE events that adds ``route`` to the event with ``usage.kv_transfer``."""
    return lambda event: _rewrite_event(event, lambda payload: set_route(payload, route))
