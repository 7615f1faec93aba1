"""What the completions and chat handlers share: checks, engine calls, usage, SSE framing.

``NodeState`` is built once by ``app.build_app`` and stored on ``app.state.node``; handlers read
it with ``node_state(request)``. The checks raise ``APIError`` with messages that name the value
and the limit (``prompt has 9000 tokens; --max-model-len is 8192``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from pdserve.engine import tracing
from pdserve.engine.request_limits import RequestLimits
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.server import checks
from pdserve.engine.server.checks import check_request, vocab_size
from pdserve.engine.server.errors import APIError, bad_request, error_event
from pdserve.engine.server.generation import Choice, ClientDisconnected, EngineCall, Generation
from pdserve.engine.server.metrics import ServerMetrics
from pdserve.engine.server.prompt_work import PromptWork
from pdserve.engine.server.tools.config import ToolConfig
from pdserve.engine.server.tools.parsers import call_id_factory, new_call_id


@dataclass(frozen=True)
class NodeState:
    engine: Any                         # AsyncEngine (pdserve.engine.core.async_engine)
    metrics: ServerMetrics
    token_text: Callable[[int], str]    # one token id -> its text, cached
    prompts: PromptWork                 # tokenization and chat templating, bounded and off the event loop
    vocab_size: int                     # token ids a request may name: [0, vocab_size)
    tools: ToolConfig = ToolConfig()    # --enable-auto-tool-choice, --tool-call-parser
    call_ids: Callable[[], str] = new_call_id   # tool-call ids the model's chat template accepts back

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def role(self) -> str:
        return getattr(self.engine, "role", "both")


def make_node_state(engine, metrics: ServerMetrics, limits: RequestLimits, tools: ToolConfig = ToolConfig()) -> NodeState:
    decode = engine.tokenizer.decode

    @lru_cache(maxsize=1 << 16)
    def token_text(token_id: int) -> str:
        return decode([token_id])

    prompts = PromptWork(engine.tokenizer, limits, lambda: engine.max_model_len)
    return NodeState(engine, metrics, token_text, prompts, vocab_size(engine.tokenizer, _model_vocab(engine)), tools,
                     call_id_factory(getattr(engine.tokenizer, "chat_template", None)))


def _model_vocab(engine) -> int | None:
    model_config = getattr(getattr(engine, "engine", None), "model_config", None)
    return getattr(model_config, "vocab_size", None)


def node_state(request: Request) -> NodeState:
    return request.app.state.node


def admit(request: Request, body) -> tuple[NodeState, str]:
    """The checks every generation endpoint starts with: the model name, then ``checks.check_request``."""
    state = node_state(request)
    model = check_model(state, body.model)
    check_request(body, state.vocab_size, state.tools)
    return state, model


async def respond(request: Request, state: NodeState, body, calls: list[EngineCall], arrival: float,
                  stream: Callable, response: Callable):
    """Run ``calls``: an SSE response built by ``stream(generation)``, or ``response(choices)`` once done."""
    parent = tracing.extract(request.headers) if tracing.enabled() else None
    generation = Generation(state.engine, state.metrics, calls, arrival, getattr(body, "n", None) or 1, parent)
    generation.start()                         # the engine has the requests before the response begins
    if body.stream:
        return sse_response(stream(generation), on_close=generation.close)
    try:
        choices = await generation.collect(request)
    except ClientDisconnected:
        raise APIError(499, "client disconnected") from None
    return response(choices)


def check_model(state: NodeState, model: str | None) -> str:
    """The served name; 404 like OpenAI/vLLM when the request names another model."""
    name = state.engine.model_name
    if model is not None and model != name:
        raise APIError(404, f"model {model!r} does not exist; this node serves {name!r}",
                       param="model", code="model_not_found")
    return name


def check_token_ids(state: NodeState, ids: list[int], param: str = "prompt") -> None:
    checks.check_token_ids(ids, state.vocab_size, param)


def resolve_max_tokens(state: NodeState, requested: int | None, num_prompt_tokens: int) -> int:
    return checks.resolve_max_tokens(state.max_model_len, requested, num_prompt_tokens)


def make_calls(request_id: str, prompts: list[list[int]], params: list[SamplingParams],
               n: int, kv_transfer_params: dict | list[dict | None] | None = None,
               cache_salt: str | None = None) -> list[EngineCall]:
    """prompts x n engine requests; choice index = prompt index * n + sample index (like vLLM).
    With a seed, sample i uses seed + i so that the n choices differ but stay reproducible.
    ``kv_transfer_params`` (one dict, or a list with one per prompt) goes to sample 0 of its prompt;
    the other samples compute their own KV. ``cache_salt`` goes to every call."""
    transfers = _per_prompt(kv_transfer_params, len(prompts))
    calls = []
    for p, (ids, base) in enumerate(zip(prompts, params)):
        for i in range(n):
            index = p * n + i
            sp = base if base.seed is None or i == 0 else replace(base, seed=base.seed + i)
            calls.append(EngineCall(f"{request_id}-{index}", index, ids, sp, transfers[p] if i == 0 else None,
                                    cache_salt))
    return calls


def _per_prompt(kv_transfer_params, num_prompts: int) -> list[dict | None]:
    if not isinstance(kv_transfer_params, list):
        if kv_transfer_params and num_prompts != 1:
            raise bad_request(f"kv_transfer_params needs exactly one prompt, got {num_prompts}; send a list "
                              "with one per prompt", "kv_transfer_params")
        return [kv_transfer_params or None] * num_prompts
    if len(kv_transfer_params) != num_prompts:
        raise bad_request(f"kv_transfer_params has {len(kv_transfer_params)} entries for {num_prompts} prompts",
                          "kv_transfer_params")
    return [t or None for t in kv_transfer_params]


def body_prompt_ids(state: NodeState, body) -> list[list[int]] | None:
    """The proxy's ``prompt_token_ids`` (it tokenized once, like the nodes) as a list of prompts, checked;
    None if absent."""
    given = body.prompt_token_ids
    if given is None:
        return None
    prompts = [list(given)] if not given or isinstance(given[0], int) else [list(p) for p in given]
    for ids in prompts:
        check_token_ids(state, ids)
    return prompts


def kv_fields(role: str, choices: list[Choice]) -> dict[str, Any]:
    """Top-level ``kv_transfer_params`` of a prefill answer (what the proxy forwards to decode)."""
    first = min(choices, key=lambda c: c.index) if choices else None
    if first is None or first.kv_transfer_params is None:
        return {}
    return {"kv_transfer_params": first.kv_transfer_params}


def usage(calls: list[EngineCall], choices: dict[int, Choice], n: int, role: str = "both") -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per sample), completion tokens per choice.

    With a KV store, ``kv_transfer`` carries the per-node accounting of choice 0: this node's
    figures under its role, and the prefill node's figures (from ``kv_transfer_params``) on a
    decode node."""
    firsts = [c for c in calls if c.index % n == 0]
    prompt = sum(len(c.prompt_ids) for c in firsts)
    cached = sum(choices[c.index].num_cached_tokens for c in firsts)
    completion = sum(len(ch.token_ids) for ch in choices.values())
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}}
    transfer = _kv_transfer_block(calls[0], choices.get(calls[0].index), role) if calls else {}
    if transfer:
        out["kv_transfer"] = transfer
    return out


def _kv_transfer_block(call: EngineCall, choice: Choice | None, role: str) -> dict[str, Any]:
    block = {}
    remote = call.kv_transfer_params or {}
    if remote.get("do_remote_prefill") and remote.get("accounting"):
        block["prefill"] = remote["accounting"]
    if choice is not None and choice.kv_accounting is not None:
        block[role] = choice.kv_accounting
    return block


def created() -> int:
    return int(time.time())


def sse(payload: dict[str, Any]) -> str:
    """One ``data:`` event, all ASCII: a raw U+2028, U+0085 or \\x1c in the text would split the line in some
    clients' line readers (JavaScript's and Python's ``str.splitlines`` among them)."""
    return f"data: {json.dumps(payload)}\n\n"


def sse_response(events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]] | None = None) -> StreamingResponse:
    """Wraps ``events``: a failure mid-stream becomes an error event; ``[DONE]`` always ends it. ``on_close``
    runs once the response is over, however it ended -- also when it never began to iterate ``events``
    (the client left first): the requests behind it are aborted then, not run to their last token."""
    async def framed() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except APIError as exc:
            yield error_event(exc.status, exc.message)
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    return _SSEResponse(framed(), on_close, media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _SSEResponse(StreamingResponse):
    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._on_close is not None:
                await self._on_close()
