"""Validate a client request once, tokenize it once, and build the bodies sent to the nodes.

Called by ``app`` for every /v1/completions and /v1/chat/completions request:

    req = await parse_request(endpoint, raw_body, tokenizer, routing)   # APIError(4xx) on bad input
    prefill_body(req)  ->  client body + max_tokens=1, stream=false, prompt_token_ids, do_remote_decode
    decode_body(req, kv_transfer_params)  ->  client body + prompt_token_ids + what prefill returned

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
from pdserve.engine.server.protocol import ChatCompletionRequest, CompletionRequest, message_dicts
from pdserve.engine.tokenizer import apply_chat_template
from pdserve.kvstore.keys import chunk_keys

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass(frozen=True)
class Routing:
    """How the proxy names prompt chunks for prefix-aware routing (keys only the proxy compares)."""
    chunk_tokens: int
    salt: str                      # e.g. "proxy:<model name>"; not the store's model fingerprint


@dataclass(frozen=True)
class ProxyRequest:
    endpoint: str                  # COMPLETIONS or CHAT
    body: dict[str, Any]           # the client's JSON body, untouched
    prompt_ids: list[int]
    chunk_keys: list[str]          # full routing chunks of the prompt, in order
    stream: bool
    max_tokens: int | None         # as the client asked; None: the node decides

    @property
    def prefill_only(self) -> bool:
        """A non-streaming one-token request: the prefill answer is the whole answer."""
        return self.max_tokens == 1 and not self.stream

    @property
    def decode_tokens(self) -> int:
        """In-flight tokens a decode call counts for least_loaded routing."""
        return len(self.prompt_ids) + (self.max_tokens or 0)


async def parse_request(endpoint: str, raw: bytes, tokenizer, routing: Routing) -> ProxyRequest:
    body = _json_object(raw)
    model = CompletionRequest if endpoint == COMPLETIONS else ChatCompletionRequest
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise bad_request(message, param) from None
    max_tokens = _check_sampling(parsed)
    prompt_ids = await asyncio.to_thread(_tokenize, parsed, tokenizer)
    if not prompt_ids:
        raise bad_request("the prompt is empty (0 tokens)", "prompt" if endpoint == COMPLETIONS else "messages")
    keys = chunk_keys(prompt_ids, routing.chunk_tokens, routing.salt)
    return ProxyRequest(endpoint, body, prompt_ids, keys, parsed.stream, max_tokens)


def prefill_body(req: ProxyRequest, model_name: str | None) -> dict[str, Any]:
    body = _with_model(req.body, model_name)
    body.pop("stream_options", None)
    body.update(max_tokens=1, stream=False, prompt_token_ids=req.prompt_ids,
                kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    if not req.prefill_only:            # decode samples the choices; prefill only has to run the prompt
        body.update(n=1, min_tokens=0)
    return body


def decode_body(req: ProxyRequest, model_name: str | None, kv_transfer_params: Any) -> dict[str, Any]:
    body = _with_model(req.body, model_name)
    body.update(prompt_token_ids=req.prompt_ids, kv_transfer_params=kv_transfer_params)
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


def _tokenize(parsed, tokenizer) -> list[int]:
    if isinstance(parsed, ChatCompletionRequest):
        try:
            return apply_chat_template(tokenizer, message_dicts(parsed.messages))
        except APIError:
            raise
        except Exception as exc:            # template errors are jinja's, not ours
            raise bad_request(f"cannot apply the chat template: {exc}", "messages") from None
    prompt = parsed.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(f"the proxy serves one prompt per request, got {len(prompt)}; "
                              "send one request per prompt", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return list(prompt)
