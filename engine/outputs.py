"""What the engine hands back: per request per step a delta (``RequestOutput``), per step its ``EngineStats``, and
``EngineDeadError`` once it has died. Consumed by ``LLM``, ``AsyncEngine``, the engine-core client and messages, and the
HTTP server; kept free of engine imports so that each of them can import it. ``PromptLogprob`` is one prompt token's
entry of ``prompt_logprobs`` (computed by ``runner/prompt_logprobs.py``, carried by ``kv_transfer_params`` too)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import msgspec


class PromptLogprob(msgspec.Struct, frozen=True, array_like=True):
    """Prompt token ``i`` (i >= 1) given tokens ``[0, i)``: its raw logprob, its rank (vLLM's: how many tokens of
    the vocabulary have a logprob >= its own, so 1 is the most likely) and the ``k`` most likely tokens, most
    likely first (their ranks are 1..k), ``k`` the request's ``prompt_logprobs``."""
    token_id: int
    logprob: float
    rank: int
    top: Annotated[list[tuple[int, float]], msgspec.Meta(max_length=20)]   # SamplingParams: prompt_logprobs <= 20

LOGPROB_FLOOR = -9999.0   # a logprob as written out (vLLM's): a token a structured-output mask forbids has -inf,
                          # which JSON cannot carry


def finite_logprob(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class RequestTimes(msgspec.Struct, frozen=True, array_like=True):
    """Where one request's time went, stamped by the engine core (``time.monotonic()`` of the core's process:
    the API process reads the same clock on the same host). 0.0: not reached. Sent with a request's first
    output that carries a token and with its final output; read by the node's metrics (queue / prefill /
    decode / inference times, KV load and publish) and its trace spans (``engine/server/request_trace.py``).

        queued ── scheduled ── first_token ─────── last_token        (vLLM's intervals: queue = scheduled -
                  kv_load_start ─ kv_load_end                         queued, prefill = first_token - scheduled,
                  (decode role: the wait in WAITING_FOR_KV,           decode = last_token - first_token,
                   inside the queue time, as vLLM counts it)          inference = last_token - scheduled)
                                   kv_publish_start ───── kv_publish_end   (prefill role: first chunk handed
                                                                            to the store -> all acknowledged)
    """
    queued: float
    scheduled: float = 0.0
    first_token: float = 0.0          # the first token sampled here (a decode node: after the prefill node's)
    last_token: float = 0.0
    num_preemptions: int = 0
    kv_load_start: float = 0.0
    kv_load_end: float = 0.0
    kv_loaded_bytes: int = 0
    kv_publish_start: float = 0.0
    kv_publish_end: float = 0.0
    kv_published_bytes: int = 0


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
    prompt_logprobs: list[PromptLogprob] | None = None   # with the first token: prompt tokens 1.. (params asked)
    # when, not what: two outputs that say the same thing compare equal whenever they were made
    times: RequestTimes | None = field(default=None, compare=False)   # with the first token and the final output
    step_time: float = field(default=0.0, compare=False)   # time.monotonic() the engine core made it (0.0: unknown):
                                             # the metrics' inter-token latency is between these, as vLLM's


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
    prompt_logprobs: list[PromptLogprob | None] | None = None   # vLLM's shape: None for the first prompt token


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_totals: dict            # cumulative KV accounting (tokens): total/local_hit/store_hit/loaded/recomputed
    kv_store: dict             # {tier: {counter: value}} of the attached store, {} without one
    kv_transfer: dict          # connector counters (load/publish failures, store health)
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int = 0            # cumulative, every preemption by recompute (vllm:num_preemptions)
    iteration_tokens: list[int] = field(default_factory=list)   # steps per ITERATION_TOKEN_BUCKETS bucket, +Inf last
    iteration_tokens_sum: int = 0       # tokens scheduled over every step


# vLLM's buckets of vllm:iteration_tokens_total (tokens scheduled in one engine step)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineDeadError(RuntimeError):
    """The engine failed (its thread, or the engine-core process); the node must be restarted."""
