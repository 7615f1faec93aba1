"""One generation request as the scheduler, the block manager and the model runner see it.

Created by ``LLMEngine.add_request``; mutated only by the ``Scheduler`` (status, token counts,
output tokens) and the ``BlockManager`` (``block_ids``, ``block_hashes``); read by the runner.

Token ranges of a request (``|`` = block boundary, block_size 4)::

    all_token_ids   p p p p | p p o o | o
                    <--- prompt ---><-out->
    computed        [0, num_computed_tokens)     KV is in the cache (blocks block_ids[:ceil(n / 4)])
    to compute      [num_computed_tokens, num_tokens)

After preemption by recompute, ``num_computed_tokens`` drops to 0 and prompt + output are
computed again as one long prompt; the output tokens are kept.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.hashing import salt_root


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()   # its structured-output constraint is compiling (engine/structured)
    WAITING_FOR_KV = enum.auto()    # decode role: remote KV is loading (reserved)
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()         # back in the waiting queue, blocks freed, will recompute
    FINISHED_STOPPED = enum.auto()  # eos, a stop token id or a stop string
    FINISHED_LENGTH = enum.auto()   # max_tokens, max_model_len or the KV cache's size
    FINISHED_ABORTED = enum.auto()  # client abort, or a request that can never fit

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    extra_eos_token_ids: tuple[int, ...] = ()   # more ids that end generation like eos (generation_config)
    cache_salt: str | None = None       # tenant isolation: only requests with the same salt share KV (vLLM's field)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0        # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)      # block table, owned by BlockManager
    block_hashes: list[int] = field(default_factory=list)   # chained hash per full block, owned by BlockManager
    num_cached_tokens: int = 0          # prefix-cache hit at the first schedule (usage.cached_tokens)
    num_preemptions: int = 0
    num_loaded_tokens: int = 0          # prompt tokens whose KV came from the store (KV connector)
    stop_reason: int | str | None = None  # stop token id, stop string, or an error message when aborted
    sampler_draws: int = 0              # draws its seeded generator made on another node (the prefill node)
    grammar_ends: bool = False          # its structured-output constraint allows nothing but its end (eos) now
    scheduled_time: float = 0.0         # time.monotonic() it first ran (RUNNING), 0.0 before: set by the Scheduler
    first_token_time: float = 0.0       # its first token sampled here; set by the OutputAssembler
    _all_token_ids: list[int] = field(init=False, repr=False)
    block_hash_parent: int | None = field(init=False, repr=False)   # parent of block 0's hash: the salt's root

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt; send at least one token")
        self.block_hash_parent = salt_root(self.cache_salt)
        self._all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output tokens; read-only view (do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI ``finish_reason``: "stop" | "length" | "abort", None while unfinished."""
        return _FINISH_REASONS.get(self.status)

    @property
    def computes_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs, computed here: it takes no cached prefix, from the prefix cache or a
        KV store (a reused prefix has no logits). A decode node gets them from the prefill node instead."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Ids the sampler may not pick for the next token: eos and stop ids until ``min_tokens`` (vLLM), unless a
        structured-output constraint allows nothing but its end: the constraint wins (the output is complete)."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens or self.grammar_ends:
            return ()
        eos = () if self.eos_token_id is None else (self.eos_token_id,)
        return (*eos, *self.extra_eos_token_ids, *params.stop_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """Status the request finishes with after its last sampled token, or None to go on.

    Called by ``Scheduler.update_from_output`` right after ``append_output_token``. Stop tokens
    (eos unless ``ignore_eos``, ``stop_token_ids``) count only once ``min_tokens`` were produced,
    and win over the length limits when both hold; a stop token id becomes ``stop_reason``.
    """
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and (last == request.eos_token_id or last in request.extra_eos_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
