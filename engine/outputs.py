"""What the engine hands back per request per step (a delta), consumed by ``LLM`` and the HTTP server."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None          # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int
    num_cached_tokens: int             # prompt tokens whose KV was reused (prefix cache)
    logprobs: list | None = None       # SampleResult per new token when requested
    error: str | None = None           # set when the engine failed the request
    kv_transfer_params: dict | None = None   # prefill role: what the decode node needs (final output)
    kv_accounting: dict | None = None        # with a KV store: total/local_hit/store_hit/... (final output)
    stop_reason: int | str | None = None     # finish_reason "stop": the stop string or stop token id (None: eos)


@dataclass
class CompletionOutput:
    """A finished request as ``LLM.generate`` returns it."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list = field(default_factory=list)
    kv_transfer_params: dict | None = None
    kv_accounting: dict | None = None
