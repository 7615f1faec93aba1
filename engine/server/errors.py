"""One OpenAI-style error body for every failure the node reports over HTTP.

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": null}}

Handlers raise ``APIError`` (or let pydantic / ``SamplingParams`` raise); ``install_error_handlers``
(called by ``app.build_app``) turns each kind into this body: validation and bad JSON -> 400,
``SamplingParamsError`` -> 400, unknown routes -> 404, anything unexpected -> 500.
Streams that fail after their 200 header send ``error_event`` as their last ``data:`` line.
"""

from __future__ import annotations

import json
import logging
import reprlib
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.engine.sampling_params import SamplingParamsError
from pdserve.engine.server.fields import refusal
from pdserve.engine.server.text import text_problem

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}


class APIError(Exception):
    """An error with its HTTP status, raised by handlers and turned into the OpenAI body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The body; ``message`` and ``param`` as UTF-8-safe text (a lone surrogate of a client's field name,
    quoted back, becomes its ``\\udXXX`` escape: the answer to a bad string must not fail to encode)."""
    return {"error": {"message": _encodable(message), "type": _TYPES.get(status, "server_error"),
                      "param": _encodable(param), "code": code}}


def _encodable(text: str | None) -> str | None:
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def error_event(status: int, message: str) -> str:
    """The SSE line a stream sends when it fails after the 200 header went out."""
    return f"data: {json.dumps(error_body(status, message))}\n\n"


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(SamplingParamsError, _on_sampling_params_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(Exception, _on_unexpected)


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else exc.headers
    return error_response(exc.status, exc.message, exc.param, exc.code, headers)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = describe_validation_errors(exc.errors())
    return error_response(400, message, param)


async def _on_sampling_params_error(request: Request, exc: SamplingParamsError) -> JSONResponse:
    return error_response(400, str(exc), exc.param)


async def _on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = str(exc.detail) if exc.status_code != 404 else f"no route {request.method} {request.url.path}"
    return error_response(exc.status_code, message)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's error list -> one readable message naming each field, its problem (with the limit) and
    its value, cut short; at most ``_MAX_ERRORS`` of them (a list of a million bad ids is one message).
    A refused field (unknown, or not implemented: ``fields``) gets its own wording."""
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return f"request body is not valid JSON: {detail}".rstrip(": "), None
    errors = _most_specific(errors)
    parts = []
    for loc, e in errors[:_MAX_ERRORS]:
        if (refused := refusal(e, loc)) is not None:          # names the field itself
            parts.append(refused)
            continue
        got = f" (got {_short(e['input'])})" if "input" in e and e.get("type") != "missing" else ""
        parts.append(f"{'.'.join(loc) or 'body'}: {_message(e)}{got}")
    if len(errors) > _MAX_ERRORS:
        parts.append(f"and {len(errors) - _MAX_ERRORS} more")
    return "; ".join(parts), ".".join(errors[0][0]) or None if errors else None


def _message(error: dict[str, Any]) -> str:
    """pydantic's message; for a field name that is not Unicode text (the only string pydantic itself finds
    so: every string field checks its value first, ``text``), what is wrong with it."""
    value = error.get("input")
    if error.get("type") == "string_unicode" and isinstance(value, str) and (problem := text_problem(value)):
        return f"the field name {_short(value)} {problem}"
    return error.get("msg", "invalid")


def _most_specific(errors: list[dict[str, Any]]) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """One error per field path, without pydantic's union branch names (``prompt.list[constrained-int].0``
    -> ``prompt.0``); of a union's errors, those that go deeper win, then those about the value (a limit)
    over those about its type."""
    located = [(tuple(str(x) for x in e.get("loc", ()) if x != "body" and not _is_union_branch(x)), e)
               for e in errors]
    prefixes = {loc[:i] for loc, _ in located for i in range(len(loc))}     # paths with a deeper error
    best: dict[tuple[str, ...], dict[str, Any]] = {}
    for loc, e in located:
        if loc not in prefixes and (loc not in best or _is_type_error(best[loc]) and not _is_type_error(e)):
            best[loc] = e
    return list(best.items())


def _is_type_error(error: dict[str, Any]) -> bool:
    return str(error.get("type", "")).endswith(("_type", "_parsing"))


def _is_union_branch(part: Any) -> bool:
    return isinstance(part, str) and (any(c in part for c in "[-,") or part in ("str", "int", "float", "bool"))


_MAX_ERRORS = 5
_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlong, _REPR.maxlevel = 60, 60, 40, 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def _short(value: Any, limit: int = 80) -> str:
    """A bounded repr: big strings, lists and dicts are cut before they are formatted."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
