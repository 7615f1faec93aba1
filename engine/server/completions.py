"""``POST /v1/completions``: text or token-id prompts, n choices per prompt, SSE streaming.

Registered by ``app.build_app``. Flow: check model and fields -> tokenize each prompt ->
one ``SamplingParams`` per prompt (max_tokens checked against --max-model-len) ->
``Generation`` over prompts x n engine requests -> OpenAI ``text_completion`` body or chunks.
``echo`` / ``prompt_logprobs`` (``echo.py``): the echoed prompt and its logprobs lead each choice's text and
logprobs -- streaming, in its first chunk, with its first token (vLLM's); each choice carries ``prompt_logprobs``
when they were computed (not streaming). ``max_tokens`` 0 with ``echo``: the prompt alone, ``finish_reason``
"length", no completion tokens (the one token the engine sampled is dropped).
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
from pdserve.engine.server.echo import legacy_logprobs, output_rows, prompt_logprobs_json, prompt_rows, prompt_texts
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
    echo = _Echo(state, body, calls, prompt_texts(state, body, prompts))
    return await respond(request, state, body, calls, arrival,
                         lambda gen: _stream(state, body, request_id, model, calls, gen, echo),
                         lambda choices: _response(state, request_id, model, calls, choices, body.n, echo))


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


class _Echo:
    """What a choice's answer puts before its generated text and logprobs (nothing without ``echo``)."""

    def __init__(self, state: NodeState, body: CompletionRequest, calls: list[EngineCall], texts: list[str] | None):
        self.state, self.texts, self.only = state, texts, body.echo_only
        self.calls = {c.index: c for c in calls}
        self.num_top, self.n = body.logprobs, body.n

    def text(self, index: int) -> str:
        return "" if self.texts is None else self.texts[index // self.n]

    def rows(self, choice: Choice) -> list:
        if self.texts is None:
            return []
        return prompt_rows(self.state, self.calls[choice.index].prompt_ids, choice.prompt_logprobs, self.num_top)

    def drop_generated(self, choice: Choice) -> None:
        """``max_tokens`` 0: the engine's one token is not part of the answer."""
        if self.only:
            choice.token_ids, choice.text, choice.logprobs, choice.finish_reason = [], "", [], "length"


def _response(state: NodeState, request_id: str, model: str, calls: list[EngineCall],
              choices: list[Choice], n: int, echo: _Echo) -> dict[str, Any]:
    for c in choices:
        echo.drop_generated(c)
    body = [{"index": c.index, "text": echo.text(c.index) + c.text, "finish_reason": c.finish_reason,
             "logprobs": legacy_logprobs(echo.rows(c) + output_rows(state, c.logprobs), 0)
             if _wants_logprobs(calls) else None,
             **_prompt_logprobs(state, c)} for c in choices]
    return {"id": request_id, "object": "text_completion", "created": created(), "model": model,
            "choices": body, "usage": usage(calls, {c.index: c for c in choices}, n, state.role),
            **kv_fields(state.role, choices)}


async def _stream(state: NodeState, body: CompletionRequest, request_id: str, model: str,
                  calls: list[EngineCall], generation: Generation, echo: _Echo) -> AsyncIterator[str]:
    choices = {c.index: Choice(c.index) for c in calls}
    sent = {c.index: -1 for c in calls}         # characters of text sent per choice; -1: nothing yet
    stamp, with_logprobs = created(), _wants_logprobs(calls)
    base = {"id": request_id, "object": "text_completion", "created": stamp, "model": model}
    async with aclosing(generation.outputs()) as deltas:
        async for index, delta in deltas:
            choice = choices[index]
            choice.add(delta)
            if not (delta.new_text or delta.finished or delta.new_token_ids) or (echo.only and not delta.finished):
                continue                                  # a chunk per step with a token, text or not (vLLM's)
            first, offset = sent[index] < 0, max(sent[index], 0)
            text, rows = delta.new_text, output_rows(state, delta.logprobs or [])
            if echo.only:
                echo.drop_generated(choice)
                text, rows = "", []
            if first:                                     # the echoed prompt leads the first chunk
                text, rows = echo.text(index) + text, echo.rows(choice) + rows
            sent[index] = offset + len(text)
            out = {"index": index, "text": text,
                   "logprobs": legacy_logprobs(rows, offset) if with_logprobs else None,
                   "finish_reason": choice.finish_reason if delta.finished else None}
            yield sse({**base, "choices": [out], **({"usage": None} if body.include_usage else {})})
    if body.include_usage:
        yield sse({**base, "choices": [], "usage": usage(calls, choices, body.n, state.role)})


def _wants_logprobs(calls: list[EngineCall]) -> bool:
    return calls[0].params.logprobs is not None


def _prompt_logprobs(state: NodeState, choice: Choice) -> dict[str, Any]:
    """The choice's ``prompt_logprobs`` field, where they were computed (asked for, or ``echo`` with logprobs)."""
    if choice.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": prompt_logprobs_json(state, choice.prompt_logprobs)}
