"""The small endpoints: ``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``POST /tokenize``,
``POST /detokenize`` (request and response shapes as vLLM's).

Registered by ``app.build_app``; ``/health`` and ``/metrics`` stay open when ``--api-key`` is set.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdserve.engine.server.common import check_model, check_token_ids, created, node_state
from pdserve.engine.server.errors import bad_request, error_response
from pdserve.engine.server.metrics import CONTENT_TYPE
from pdserve.engine.server.protocol import DetokenizeRequest, TokenizeRequest, message_dicts

router = APIRouter()      # behind the API key when one is set
open_router = APIRouter()  # always open: probes and scrapers carry no key


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = node_state(request)
    name = state.engine.model_name
    card = {"id": name, "object": "model", "created": created(), "owned_by": "pdserve", "root": name,
            "parent": None, "max_model_len": state.max_model_len}
    kv_card = getattr(state.engine, "kv_card", None)       # the proxy's kv_aware routing reads it
    if kv_card is not None:
        card["kv"] = kv_card()
    return {"object": "list", "data": [card]}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = node_state(request)
    check_model(state, body.model)
    _check_tokenize_fields(body)
    if body.messages is not None:
        ids = await state.prompts.chat(message_dicts(body.messages), body.add_generation_prompt,
                                       [t.model_dump(exclude_none=True) for t in body.tools or ()] or None)
    else:
        special = body.add_special_tokens is not False
        ids = await state.prompts.encode(body.prompt, add_special_tokens=special)
    strs = state.prompts.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


def _check_tokenize_fields(body: TokenizeRequest) -> None:
    """One of ``prompt`` / ``messages``, and only the fields that act on it (nothing taken and ignored)."""
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of 'prompt' or 'messages'")
    if body.messages is not None and body.add_special_tokens:
        raise bad_request("add_special_tokens=true is not supported with messages: the chat template writes the "
                          "special tokens; send false or leave it out", "add_special_tokens")
    if body.prompt is not None and "add_generation_prompt" in body.model_fields_set:
        raise bad_request("add_generation_prompt applies to messages only; leave it out with a prompt",
                          "add_generation_prompt")


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = node_state(request)
    check_model(state, body.model)
    check_token_ids(state, body.tokens, "tokens")
    return {"prompt": await state.prompts.decode(body.tokens)}


@open_router.get("/health")
async def health(request: Request) -> Response:
    if node_state(request).engine.is_healthy():
        return JSONResponse({"status": "ok"})
    return error_response(503, "the engine is not healthy; see the node's log")


@open_router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(node_state(request).metrics.render(), media_type=CONTENT_TYPE)
