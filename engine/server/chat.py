"""``POST /v1/chat/completions``: messages -> the model's chat template -> n choices, SSE streaming.

Registered by ``app.build_app``. The prompt is ``engine.tokenizer.apply_chat_template(messages,
add_generation_prompt)`` (through ``NodeState.prompts``: a sandboxed template, a worker thread, a
deadline): rendered to text and encoded without extra special tokens (the template already has
them), as vLLM does; the proxy tokenizes with the same function. Unset ``max_tokens`` means "up to
--max-model-len". vLLM's extras: ``echo`` puts the last message's content before each choice's when its role is
the answer's (streaming: a chunk of its own after the role chunks), ``prompt_logprobs`` (not streaming) comes as
the answer's top-level ``prompt_logprobs`` (``echo.py``). Tools (``tools/``): the template sees them; each
choice's text goes through the request's tool-call parser (forced calls, or ``--tool-call-parser`` under "auto"),
whole or a delta at a time, into ``message.tool_calls`` / ``delta.tool_calls``; ``finish_reason`` "tool_calls".
"""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request

from pdserve.engine.outputs import finite_logprob
from pdserve.engine.server.common import (NodeState, admit, body_prompt_ids, created, kv_fields, make_calls,
                                          resolve_max_tokens, respond, sse, usage)
from pdserve.engine.server.echo import chat_echo, prompt_logprobs_json
from pdserve.engine.server.errors import bad_request
from pdserve.engine.server.generation import Choice, EngineCall, Generation
from pdserve.engine.server.protocol import ChatCompletionRequest, message_dicts
from pdserve.engine.server.structured import check_structured
from pdserve.engine.server.tools.parsers import ToolOutputParser
from pdserve.engine.server.tools.plan import ToolPlan
from pdserve.engine.server.tools.render import delta_fields, finish_reason, message_fields

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    arrival = time.monotonic()
    state, model = admit(request, body)
    await check_structured(body, state.prompts)       # the proxy's order: after check_request, before tokenizing
    given = body_prompt_ids(state, body)
    if given is not None and len(given) != 1:
        raise bad_request(f"a chat request has one prompt; prompt_token_ids has {len(given)}", "prompt_token_ids")
    plan = ToolPlan.of(body)
    prompt_ids = given[0] if given is not None else \
        await state.prompts.chat(message_dicts(body.messages), body.add_generation_prompt, plan.template_tools)
    max_tokens = resolve_max_tokens(state, body.requested_max_tokens, len(prompt_ids))
    params = body.to_sampling_params(max_tokens, body.engine_logprobs)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    calls = make_calls(request_id, [prompt_ids], [params], body.n, body.kv_transfer_params, body.cache_salt)
    parser = lambda: plan.parser(state.tools, state.call_ids)      # noqa: E731 - one per choice
    return await respond(request, state, body, calls, arrival,
                         lambda gen: _stream(state, body, request_id, model, calls, gen, parser),
                         lambda choices: _response(state, body, request_id, model, calls, choices, parser))


def _response(state: NodeState, body: ChatCompletionRequest, request_id: str, model: str, calls: list[EngineCall],
              choices: list[Choice], parser: Callable[[], ToolOutputParser | None]) -> dict[str, Any]:
    with_logprobs, echoed = calls[0].params.logprobs is not None, chat_echo(body)
    answer = []
    for c in choices:
        reader = parser()
        message = {"content": c.text} if reader is None else message_fields(reader, c.text)
        if echoed and message["content"] is not None:
            message["content"] = echoed + message["content"]
        answer.append({"index": c.index, "message": {"role": "assistant", **message},
                       "logprobs": _logprobs(state, c.logprobs) if with_logprobs else None,
                       "finish_reason": finish_reason(reader, c.finish_reason)})
    prompt = choices[0].prompt_logprobs if choices else None
    return {"id": request_id, "object": "chat.completion", "created": created(), "model": model,
            "choices": answer, "usage": usage(calls, {c.index: c for c in choices}, body.n, state.role),
            **({"prompt_logprobs": prompt_logprobs_json(state, prompt)} if prompt is not None else {}),
            **kv_fields(state.role, choices)}


async def _stream(state: NodeState, body: ChatCompletionRequest, request_id: str, model: str,
                  calls: list[EngineCall], generation: Generation,
                  parser: Callable[[], ToolOutputParser | None]) -> AsyncIterator[str]:
    choices = {c.index: Choice(c.index) for c in calls}
    readers = {c.index: parser() for c in calls}
    with_logprobs = calls[0].params.logprobs is not None
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created(), "model": model}
    extra = {"usage": None} if body.include_usage else {}
    forced = any(r is not None and r.forced for r in readers.values())
    for index in choices:   # the role comes first, in its own chunk, as OpenAI sends it (content null: calls only)
        choice = {"index": index, "delta": {"role": "assistant", "content": None if forced else ""},
                  "logprobs": None, "finish_reason": None}
        yield sse({**base, "choices": [choice], **extra})
    if (echoed := chat_echo(body)) and not forced:        # a forced call's answer has no content to echo into
        for index in choices:
            choice = {"index": index, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None}
            yield sse({**base, "choices": [choice], **extra})
    async with aclosing(generation.outputs()) as deltas:
        async for index, delta in deltas:
            choices[index].add(delta)
            if not (delta.new_text or delta.finished or delta.new_token_ids):   # a chunk per step with a token,
                continue                                                       # text or not (vLLM's)
            reader = readers[index]
            fields = _delta_fields(reader, delta)
            if reader is not None and not (fields or delta.finished or with_logprobs):
                continue                                  # text a tool-call parser holds back (a tag arriving)
            choice = {"index": index, "delta": fields,
                      "logprobs": _logprobs(state, delta.logprobs or []) if with_logprobs else None,
                      "finish_reason": finish_reason(reader, delta.finish_reason) if delta.finished else None}
            yield sse({**base, "choices": [choice], **extra})
    if body.include_usage:
        yield sse({**base, "choices": [], "usage": usage(calls, choices, body.n, state.role)})


def _delta_fields(reader: ToolOutputParser | None, delta) -> dict[str, Any]:
    """A chunk's ``delta``: the new text as content, or what the tool-call parser makes of it (and, at the end,
    what it held back)."""
    if reader is None:
        return {"content": delta.new_text} if delta.new_text or delta.new_token_ids else {}
    parsed = reader.feed(delta.new_text)
    if delta.finished:
        tail = reader.finish()
        parsed.content += tail.content
        parsed.calls += tail.calls
    return delta_fields(parsed)


def _logprobs(state: NodeState, results: list) -> dict[str, Any]:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = state.token_text(token_id)
        return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    content = [{**entry(r.token_id, r.logprob),
                "top_logprobs": [entry(t, lp) for t, lp in (r.top_logprobs or [])]} for r in results]
    return {"content": content}
