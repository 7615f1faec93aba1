"""Validate a client request once, tokenize it once, and build the bodies sent to the nodes.

Called by ``app`` for every /v1/completions and /v1/chat/completions request, once FastAPI has parsed
the body into the nodes' own pydantic model (so a bad body gets the node's 400 word for word):

    req = await admit_request(endpoint, body, parsed, gate, cache_salt=salt)   # APIError(4xx) if bad
    prefill_body(req, model, i)  ->  client body + prompt i's token ids, max_tokens=1 (0: echo's, kept),
                                     stream=false, n=1, min_tokens=min(client's, 1), do_remote_decode
    decode_body(req, model, kv)  ->  client body + prompt_token_ids + what prefill returned (a list of
                                     both, one per prompt, when the client sent several prompts)

``cache_salt`` is the salt both nodes get (the client's, or the tenant's from ``tenants``, which replaces
the client's in the bodies); the routing keys mix it too, so prefix-aware routing never sends a tenant
after another tenant's prefix.

``admit_request`` runs the nodes' checks in the nodes' order: ``checks.check_request`` (unsupported
fields, tool_choice against the tools and ``--enable-auto-tool-choice``, vocabulary, choices, SamplingParams ranges), the structured-output constraint (``check_structured``:
xgrammar parses it in a worker thread; a bad schema, regex or grammar is the nodes' 400), the character limit of each prompt, tokenizing
(``PromptWork.encode_prompts``: a request's prompts of up to ``INLINE_ENCODE_CHARS`` characters in all on the
event loop, a larger request's in a worker thread with a deadline), token ids against the vocabulary, and -- once a node has
told its ``max_model_len`` -- the prompt against it. A request the proxy accepts is one the nodes
accept; a bad one is refused before any node is called. ``parse_request`` does the same from raw
bytes (tests, tools).

The prefill node samples the first token with the client's parameters (seed, logprobs, stop ids,
``min_tokens`` capped at the one token it makes), so that the first token is the one a colocated
node would pick; it travels to the decode node in ``kv_transfer_params``, as do the prompt logprobs a request
with ``prompt_logprobs`` or ``echo`` + ``logprobs`` asks for (the prefill node runs the prompt, the decode node
computes none). ``echo`` with ``max_tokens`` 0 (one prompt, not streaming) is answered by the prefill node alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pdserve.engine.request_limits import RequestLimits
from pdserve.engine.server.checks import check_request, check_token_ids, resolve_max_tokens, vocab_size
from pdserve.engine.server.errors import bad_request, describe_validation_errors
from pdserve.engine.server.prompt_work import PromptWork
from pdserve.engine.server.protocol import ChatCompletionRequest, CompletionRequest, message_dicts, prompt_list
from pdserve.engine.server.structured import check_structured
from pdserve.engine.server.tools.config import ToolConfig
from pdserve.engine.server.tools.plan import ToolPlan
from pdserve.engine.kv.kv_events import public_hash
from pdserve.engine.sched.hashing import block_hashes, salt_root
from pdserve.kvstore.keys import chunk_keys

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass(frozen=True)
class Routing:
    """How the proxy names prompt chunks for routing. Until a node told its store's key space, keys only the
    proxy compares (``salt`` "proxy:<model name>"); then (``store``) the store's own chunk keys -- ``salt`` the
    nodes' model fingerprint, the last partial chunk included, as the nodes publish it -- which the proxy looks up.
    With ``events_key`` each prompt also gets its blocks' public hashes, to match the nodes' KV events."""
    chunk_tokens: int
    salt: str                      # "proxy:<model name>", or the store's model fingerprint (store=True)
    store: bool = False
    block_size: int = 0            # the nodes' --block-size (with events_key)
    events_key: bytes | None = None

    def keys(self, ids: list[int], cache_salt: str | None) -> list[str]:
        return chunk_keys(ids, self.chunk_tokens, self.salt, include_partial=self.store, cache_salt=cache_salt)

    def block_hashes(self, ids: list[int], cache_salt: str | None) -> tuple[int, ...]:
        """The public hashes of the prompt's full blocks, as the nodes' KV events name them; () without events."""
        if self.events_key is None:
            return ()
        hashes = block_hashes(ids, self.block_size, parent=salt_root(cache_salt))
        return tuple(public_hash(self.events_key, h) for h in hashes)


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    chunk_keys: list[str]          # routing chunks of the prompt, in order (Routing.keys)
    block_hashes: tuple[int, ...] = ()   # Routing.block_hashes


@dataclass(frozen=True)
class ProxyRequest:
    endpoint: str                  # COMPLETIONS or CHAT
    body: dict[str, Any]           # the client's JSON body, untouched
    prompts: list[Prompt]          # one for chat; one per prompt of a completions prompt list
    stream: bool
    max_tokens: int | None         # as the client asked; None: the node decides
    min_tokens: int = 0            # as the client asked
    cache_salt: str | None = None  # what the nodes get as ``cache_salt`` (None: the body has none)

    @property
    def prompt_ids(self) -> list[int]:
        """The first prompt's token ids (the only one, unless a completions prompt list)."""
        return self.prompts[0].ids

    @property
    def chunk_keys(self) -> list[str]:
        """Routing keys of the first prompt (decode routing)."""
        return self.prompts[0].chunk_keys

    @property
    def prefill_only(self) -> bool:
        """A non-streaming one-token (or echo-only: ``max_tokens`` 0) request for one prompt: the prefill answer
        is the whole answer."""
        return self.max_tokens in (0, 1) and not self.stream and len(self.prompts) == 1

    @property
    def decode_tokens(self) -> int:
        """In-flight tokens a decode call counts for least_loaded routing."""
        return sum(len(p.ids) + (self.max_tokens or 0) for p in self.prompts)


@dataclass(frozen=True)
class Gate:
    """What the proxy checks requests against: the nodes' tokenizer and vocabulary, its limits."""
    prompts: PromptWork
    vocab_size: int
    routing: Routing
    max_model_len: Callable[[], int | None]      # the nodes' (health probes); None until one answered
    tools: ToolConfig = ToolConfig()             # the nodes' tool-call flags (tool_choice "auto")

    @classmethod
    def build(cls, tokenizer, routing: Routing, limits: RequestLimits = RequestLimits(),
              max_model_len: Callable[[], int | None] = lambda: None, model_vocab_size: int | None = None,
              tools: ToolConfig = ToolConfig()) -> "Gate":
        return cls(PromptWork(tokenizer, limits, max_model_len), vocab_size(tokenizer, model_vocab_size), routing,
                   max_model_len, tools)


async def parse_request(endpoint: str, raw: bytes, tokenizer, routing: Routing,
                        gate: Gate | None = None) -> ProxyRequest:
    """``admit_request`` from raw bytes: JSON, then the nodes' pydantic model."""
    body = _json_object(raw)
    model = CompletionRequest if endpoint == COMPLETIONS else ChatCompletionRequest
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise bad_request(message, param) from None
    return await admit_request(endpoint, body, parsed, gate or Gate.build(tokenizer, routing),
                               cache_salt=parsed.cache_salt)


async def admit_request(endpoint: str, body: dict[str, Any], parsed, gate: Gate, *,
                        cache_salt: str | None) -> ProxyRequest:
    """``body``: the client's JSON object; ``parsed``: it as a CompletionRequest / ChatCompletionRequest;
    ``cache_salt``: the salt the nodes get (the client's ``parsed.cache_salt``, or the tenant's)."""
    _check_client_fields(body)
    check_request(parsed, gate.vocab_size, gate.tools)
    await check_structured(parsed, gate.prompts)
    prompts = await _tokenize(parsed, gate)
    param = "prompt" if endpoint == COMPLETIONS else "messages"
    if not prompts or not all(prompts):
        raise bad_request("the prompt is empty (0 tokens)", param)
    if (limit := gate.max_model_len()) is not None:
        for ids in prompts:
            resolve_max_tokens(limit, parsed.requested_max_tokens, len(ids))
    routing = gate.routing
    routed = [Prompt(ids, routing.keys(ids, cache_salt), routing.block_hashes(ids, cache_salt)) for ids in prompts]
    return ProxyRequest(endpoint, body, routed, parsed.stream, parsed.requested_max_tokens, parsed.min_tokens,
                        cache_salt)


def prefill_body(req: ProxyRequest, model_name: str | None, index: int = 0) -> dict[str, Any]:
    """The prefill call for prompt ``index``: the client's sampling parameters, one token."""
    body = _node_body(req, model_name)
    body.pop("stream_options", None)
    body.update(max_tokens=0 if req.max_tokens == 0 else 1, stream=False, prompt_token_ids=req.prompts[index].ids,
                min_tokens=min(req.min_tokens, 1),
                kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    if not req.prefill_only:            # decode samples the choices; prefill only makes choice 0's first token
        body["n"] = 1
    return body


def decode_body(req: ProxyRequest, model_name: str | None, kv_transfer_params: list[Any]) -> dict[str, Any]:
    """The decode call: the client's body, its prompts' token ids and what each prompt's prefill returned."""
    body = _node_body(req, model_name)
    if len(req.prompts) == 1:
        body.update(prompt_token_ids=req.prompt_ids, kv_transfer_params=kv_transfer_params[0])
    else:
        body.update(prompt_token_ids=[p.ids for p in req.prompts], kv_transfer_params=list(kv_transfer_params))
    return body


def _node_body(req: ProxyRequest, model_name: str | None) -> dict[str, Any]:
    """A copy of the client's body with the nodes' model name and the request's ``cache_salt``."""
    out = dict(req.body)
    if model_name is not None:
        out["model"] = model_name
    if req.cache_salt is not None:
        out["cache_salt"] = req.cache_salt
    return out


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_client_fields(body: dict[str, Any]) -> None:
    for field in ("prompt_token_ids", "kv_transfer_params"):
        if field in body:
            raise bad_request(f"{field} is set by the proxy, not by clients", field)


async def _tokenize(parsed, gate: Gate) -> list[list[int]]:
    """Token ids of each prompt, exactly as the node computes them (and with its limits)."""
    if isinstance(parsed, ChatCompletionRequest):
        return [await gate.prompts.chat(message_dicts(parsed.messages), parsed.add_generation_prompt,
                                        ToolPlan.of(parsed).template_tools)]
    out = await gate.prompts.encode_prompts(prompt_list(parsed.prompt))
    for ids in out:
        check_token_ids(ids, gate.vocab_size)
    return out
