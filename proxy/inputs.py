"""Validate a client request once, tokenize it once, and build the bodies sent to the nodes.

Called by ``app`` for every /v1/completions and /v1/chat/completions request:

    req = await parse_request(endpoint, raw_body, tokenizer, routing)   # APIError(4xx) on bad input
    prefill_body(req, model, i)  ->  client body + prompt i's token ids, max_tokens=1, stream=false,
                                     n=1, min_tokens=min(client's, 1), do_remote_decode
    decode_body(req, model, kv)  ->  client body + prompt_token_ids + what prefill returned (a list of
                                     both, one per prompt, when the client sent several prompts)

The prefill node samples the first token with the client's parameters (seed, logprobs, stop ids,
``min_tokens`` capped at the one token it makes), so that the first token is the one a colocated
node would pick; it travels to the decode node in ``kv_transfer_params``.

Validation reuses the nodes' own pydantic models and ``SamplingParams`` checks, so a request
the proxy accepts is one the nodes accept, and a bad one is refused before any node is called.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pdserve.engine.sampling_params import SamplingParamsError
from pdserve.engine.server.errors import APIError, bad_request, describe_validation_errors
from pdserve.engine.server.protocol import ChatCompletionRequest, CompletionRequest, message_dicts, prompt_list
from pdserve.engine.tokenizer import apply_chat_template
from pdserve.kvstore.keys import chunk_keys

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass(frozen=True)
class Routing:
    """How the proxy names prompt chunks for prefix-aware routing (keys only the proxy compares)."""
    chunk_tokens: int
    salt: str                      # e.g. "proxy:<model name>"; not the store's model fingerprint


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    chunk_keys: list[str]          # full routing chunks of the prompt, in order


@dataclass(frozen=True)
class ProxyRequest:
    endpoint: str                  # COMPLETIONS or CHAT
    body: dict[str, Any]           # the client's JSON body, untouched
    prompts: list[Prompt]          # one for chat; one per prompt of a completions prompt list
    stream: bool
    max_tokens: int | None         # as the client asked; None: the node decides
    min_tokens: int = 0            # as the client asked

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
        """A non-streaming one-token request for one prompt: the prefill answer is the whole answer."""
        return self.max_tokens == 1 and not self.stream and len(self.prompts) == 1

    @property
    def decode_tokens(self) -> int:
        """In-flight tokens a decode call counts for least_loaded routing."""
        return sum(len(p.ids) + (self.max_tokens or 0) for p in self.prompts)


async def parse_request(endpoint: str, raw: bytes, tokenizer, routing: Routing) -> ProxyRequest:
    body = _json_object(raw)
    model = CompletionRequest if endpoint == COMPLETIONS else ChatCompletionRequest
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise bad_request(message, param) from None
    max_tokens = _check_sampling(parsed)
    prompts = await asyncio.to_thread(_tokenize, parsed, tokenizer)
    if not prompts or not all(prompts):
        raise bad_request("the prompt is empty (0 tokens)", "prompt" if endpoint == COMPLETIONS else "messages")
    routed = [Prompt(ids, chunk_keys(ids, routing.chunk_tokens, routing.salt)) for ids in prompts]
    return ProxyRequest(endpoint, body, routed, parsed.stream, max_tokens, parsed.min_tokens)


def prefill_body(req: ProxyRequest, model_name: str | None, index: int = 0) -> dict[str, Any]:
    """The prefill call for prompt ``index``: the client's sampling parameters, one token."""
    body = _with_model(req.body, model_name)
    body.pop("stream_options", None)
    body.update(max_tokens=1, stream=False, prompt_token_ids=req.prompts[index].ids,
                min_tokens=min(req.min_tokens, 1),
                kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    if not req.prefill_only:            # decode samples the choices; prefill only makes choice 0's first token
        body["n"] = 1
    return body


def decode_body(req: ProxyRequest, model_name: str | None, kv_transfer_params: list[Any]) -> dict[str, Any]:
    """The decode call: the client's body, its prompts' token ids and what each prompt's prefill returned."""
    body = _with_model(req.body, model_name)
    if len(req.prompts) == 1:
        body.update(prompt_token_ids=req.prompt_ids, kv_transfer_params=kv_transfer_params[0])
    else:
        body.update(prompt_token_ids=[p.ids for p in req.prompts], kv_transfer_params=list(kv_transfer_params))
    return body


def _with_model(body: dict[str, Any], model_name: str | None) -> dict[str, Any]:
    out = dict(body)
    if model_name is not None:
        out["model"] = model_name
    return out


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    for field in ("prompt_token_ids", "kv_transfer_params"):
        if field in body:
            raise bad_request(f"{field} is set by the proxy, not by clients", field)
    return body


def _check_sampling(parsed) -> int | None:
    """The node's own range checks; returns the requested max_tokens."""
    if (message := parsed.unsupported()) is not None:
        raise bad_request(message)
    if isinstance(parsed, ChatCompletionRequest):
        max_tokens, logprobs = parsed.requested_max_tokens, parsed.engine_logprobs
    else:
        max_tokens, logprobs = parsed.max_tokens, parsed.logprobs
    try:
        parsed.to_sampling_params(max_tokens if max_tokens is not None else 1, logprobs)
    except SamplingParamsError as exc:
        raise bad_request(str(exc)) from None
    return max_tokens


def _tokenize(parsed, tokenizer) -> list[list[int]]:
    """Token ids of each prompt, exactly as the node would compute them."""
    if isinstance(parsed, ChatCompletionRequest):
        try:
            return [apply_chat_template(tokenizer, message_dicts(parsed.messages), parsed.add_generation_prompt)]
        except APIError:
            raise
        except Exception as exc:            # template errors are jinja's, not ours
            raise bad_request(f"cannot apply the chat template: {exc}", "messages") from None
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt_list(parsed.prompt)]
