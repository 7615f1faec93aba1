"""``POST /v1/completions``: text or token-id prompts, n choices per prompt, SSE streaming.

Registered by ``app.build_app``. Flow: check model and fields -> tokenize each prompt ->
one ``SamplingParams`` per prompt (max_tokens checked against --max-model-len) ->
``Generation`` over prompts x n engine requests -> OpenAI ``text_completion`` body or chunks.
"""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from pdserve.engine.outputs import finite_logprob
from pdserve.engine.server.common import (NodeState, admit, body_prompt_ids, check_token_ids, created,
                                          kv_fields, make_calls, resolve_max_tokens, respond, sse, usage)
from pdserve.engine.server.errors import bad_request
from pdserve.engine.server.generation import Choice, EngineCall, Generation
from pdserve.engine.server.protocol import CompletionRequest, prompt_list
from pdserve.engine.server.structured import check_structured

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    arrival = time.monotonic()
    state, model = admit(request, body)
    await check_structured(body, state.prompts)       # the proxy's order: after check_request, before tokenizing
    given = body_prompt_ids(state, body)
    prompts = given if given is not None else await _tokenize_prompts(state, body.prompt)
    params = [body.to_sampling_params(resolve_max_tokens(state, body.max_tokens, len(ids)), body.logprobs)
              for ids in prompts]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    calls = make_calls(request_id, prompts, params, body.n, body.kv_transfer_params, body.cache_salt)
    return await respond(request, state, body, calls, arrival,
                         lambda gen: _stream(state, body, request_id, model, calls, gen),
                         lambda choices: _response(state, request_id, model, calls, choices, body.n))


async def _tokenize_prompts(state: NodeState, prompt) -> list[list[int]]:
    """Each prompt's token ids: text through ``state.prompts`` (character limit, worker thread, deadline),
    token ids checked against the vocabulary."""
    prompts = prompt_list(prompt)
    if not prompts:
        raise bad_request("prompt is empty; send at least one token", "prompt")
    out = await state.prompts.encode_prompts(prompts)
    for ids in out:
        check_token_ids(state, ids)
    return out


def _response(state: NodeState, request_id: str, model: str, calls: list[EngineCall],
              choices: list[Choice], n: int) -> dict[str, Any]:
    body = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
             "logprobs": _logprobs(state, c.logprobs, 0) if _wants_logprobs(calls) else None}
            for c in choices]
    return {"id": request_id, "object": "text_completion", "created": created(), "model": model,
            "choices": body, "usage": usage(calls, {c.index: c for c in choices}, n, state.role),
            **kv_fields(state.role, choices)}


async def _stream(state: NodeState, body: CompletionRequest, request_id: str, model: str,
                  calls: list[EngineCall], generation: Generation) -> AsyncIterator[str]:
    choices = {c.index: Choice(c.index) for c in calls}
    stamp, with_logprobs = created(), _wants_logprobs(calls)
    base = {"id": request_id, "object": "text_completion", "created": stamp, "model": model}
    async with aclosing(generation.outputs()) as deltas:
        async for index, delta in deltas:
            offset = len(choices[index].text)
            choices[index].add(delta)
            if not (delta.new_text or delta.finished or delta.new_token_ids):   # a chunk per step with a token,
                continue                                                       # text or not (vLLM's)
            choice = {"index": index, "text": delta.new_text,
                      "logprobs": _logprobs(state, delta.logprobs or [], offset) if with_logprobs else None,
                      "finish_reason": delta.finish_reason if delta.finished else None}
            yield sse({**base, "choices": [choice], **({"usage": None} if body.include_usage else {})})
    if body.include_usage:
        yield sse({**base, "choices": [], "usage": usage(calls, choices, body.n, state.role)})


def _wants_logprobs(calls: list[EngineCall]) -> bool:
    return calls[0].params.logprobs is not None


def _logprobs(state: NodeState, results: list, text_offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists per token; top_logprobs include the chosen token."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for r in results:
        text = state.token_text(r.token_id)
        tokens.append(text)
        token_logprobs.append(finite_logprob(r.logprob))
        alternatives = {state.token_text(t): finite_logprob(lp) for t, lp in (r.top_logprobs or [])}
        alternatives.setdefault(text, finite_logprob(r.logprob))
        top.append(alternatives)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
