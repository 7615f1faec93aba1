"""Per-request sampling parameters (the OpenAI / vLLM knobs), validated once.

Built by the HTTP server (from a request body) or by users of ``LLM.generate``;
read by the sampler (``pdserve.engine.runner.sampler``) and by the scheduler's stop checks.
Every field is checked for its type and range here, so a value that passes cannot fail a step:
``seed`` fits a ``torch.Generator`` (int64 .. uint64), floats are finite (and fit float32, the
sampler's dtype, where a temperature of 3.4e38 becomes inf), token ids are >= 0
(ids past the vocabulary, which only the node knows, are refused by the HTTP edge and never
banned or biased by the sampler). ``logit_bias`` (a dict of token id -> bias, JSON's string keys
accepted) is kept as a sorted tuple of (id, bias) pairs, so the params stay frozen and hashable.
A temperature below ``GREEDY_TEMPERATURE`` is greedy, as in vLLM: dividing logits by it would overflow
them to inf and the distribution to NaN.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from pdserve.engine.structured.spec import StructuredOutputs

SEED_MIN, SEED_MAX = -2**63, 2**64 - 1      # what torch.Generator.manual_seed accepts
GREEDY_TEMPERATURE = 1e-5                   # vLLM's _SAMPLING_EPS: below it, sampling is argmax
MAX_TEMPERATURE = 1e6                       # far beyond uniform; float32 logits / inf would be NaN at -inf
REPETITION_PENALTY_RANGE = (1e-3, 1e3)      # beyond it logits / penalty overflow (or vanish)
MAX_LOGPROBS = 20                           # top logprobs per token, prompt_logprobs too (vLLM's --max-logprobs)
PENALTY_RANGE = (-2.0, 2.0)                 # presence_penalty, frequency_penalty (OpenAI's range)
LOGIT_BIAS_RANGE = (-100.0, 100.0)          # each logit_bias value (OpenAI's range)
MAX_LOGIT_BIAS = 1024                       # logit_bias entries (the HTTP edge's bound, protocol.py)
TOKEN_ID_MAX = 2**31 - 1                    # int32, as the HTTP edge bounds every token id


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the value and the limit, ``param`` the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1            # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0 = only the chosen one)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0            # OpenAI: minus this if the token was generated before
    frequency_penalty: float = 0.0           # OpenAI: minus this times the token's count in the output
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) added to its logit before sampling
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    structured: StructuredOutputs | None = None   # the output must match it (engine/structured)
    prompt_logprobs: int | None = None   # vLLM's: each prompt token's logprob and this many top ones (0..20)

    def __post_init__(self) -> None:
        # Accept lists from JSON; keep the dataclass hashable/frozen.
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._check_types()
        self._check()
        self._check_prompt_logprobs()

    def _check_types(self) -> None:
        """Integers and finite numbers (numpy scalars too), stored as plain int / float."""
        for name in ("max_tokens", "top_k", "min_tokens", "seed", "logprobs"):
            value = getattr(self, name)
            if value is not None or name not in ("seed", "logprobs"):
                _require(_is_int(value), f"{name} must be an integer, got {_short(value)}", name)
                object.__setattr__(self, name, int(value))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_number(value) and math.isfinite(value), f"{name} must be a finite number, got {_short(value)}",
                     name)
            object.__setattr__(self, name, float(value))
        _require(all(_is_int(t) for t in self.stop_token_ids),
                 f"stop_token_ids must be integers, got {_short(list(self.stop_token_ids))}", "stop_token_ids")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _require(all(_is_int(t) and _is_number(b) and math.isfinite(b) for t, b in self.logit_bias),
                 f"logit_bias must map token ids to finite numbers, got {_short(list(self.logit_bias))}", "logit_bias")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in self.logit_bias)))

    def _check(self) -> None:
        _require(self.max_tokens >= 1, f"max_tokens must be >= 1, got {_short(self.max_tokens)}", "max_tokens")
        _require(self.temperature >= 0.0, f"temperature must be >= 0, got {_short(self.temperature)}", "temperature")
        _require(self.temperature <= MAX_TEMPERATURE,
                 f"temperature must be at most {MAX_TEMPERATURE:g}, got {_short(self.temperature)}", "temperature")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {_short(self.top_p)}", "top_p")
        _require(self.top_k == -1 or self.top_k >= 0, f"top_k must be -1 (off) or >= 0, got {_short(self.top_k)}",
                 "top_k")
        _require(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {_short(self.min_p)}", "min_p")
        low, high = REPETITION_PENALTY_RANGE
        _require(low <= self.repetition_penalty <= high,
                 f"repetition_penalty must be in [{low:g}, {high:g}], got {_short(self.repetition_penalty)}",
                 "repetition_penalty")
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            _require(low <= getattr(self, name) <= high,
                     f"{name} must be in [{low:g}, {high:g}], got {_short(getattr(self, name))}", name)
        self._check_logit_bias()
        _require(self.logprobs is None or 0 <= self.logprobs <= 20,
                 f"logprobs must be in [0, 20], got {_short(self.logprobs)}", "logprobs")
        _require(self.min_tokens >= 0, f"min_tokens must be >= 0, got {_short(self.min_tokens)}", "min_tokens")
        _require(self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
                 f"seed must be in [-2^63, 2^64 - 1], got {_short(self.seed)}", "seed")
        _require(all(t >= 0 for t in self.stop_token_ids),
                 f"stop_token_ids must be >= 0, got {_short(list(self.stop_token_ids))}", "stop_token_ids")
        _require(all(isinstance(s, str) and s for s in self.stop),
                 f"stop strings must be non-empty strings, got {_short(list(self.stop))}", "stop")

    def _check_prompt_logprobs(self) -> None:
        value = self.prompt_logprobs
        if value is None:
            return
        _require(_is_int(value), f"prompt_logprobs must be an integer, got {_short(value)}", "prompt_logprobs")
        _require(0 <= value <= MAX_LOGPROBS, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {_short(value)}",
                 "prompt_logprobs")
        object.__setattr__(self, "prompt_logprobs", int(value))

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        _require(len(bias) <= MAX_LOGIT_BIAS, f"logit_bias has {len(bias)} entries; the limit is {MAX_LOGIT_BIAS}",
                 "logit_bias")
        low, high = LOGIT_BIAS_RANGE
        bad = next(((t, b) for t, b in bias if not (0 <= t <= TOKEN_ID_MAX and low <= b <= high)), None)
        _require(bad is None, f"logit_bias entries must be token id in [0, {TOKEN_ID_MAX}] -> bias in "
                              f"[{low:g}, {high:g}], got {_short(bad)}", "logit_bias")
        ids = [t for t, _ in bias]
        _require(len(set(ids)) == len(ids), f"logit_bias names a token id twice: {_short(ids)}", "logit_bias")

    @property
    def penalised(self) -> bool:
        """Whether the sampler needs the counts of this request's generated tokens."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _bias_pairs(value) -> tuple:
    """``logit_bias`` as given (a dict, or (id, bias) pairs) -> a tuple of pairs; JSON's digit-string keys
    become ints. Anything else is left for ``_check_types`` to refuse by name."""
    if value is None:
        return ()
    if isinstance(value, dict):
        value = value.items()
    try:
        pairs = tuple(tuple(p) for p in value)
    except TypeError:
        raise SamplingParamsError(f"logit_bias must be a dict of token id -> bias, got {_short(value)}",
                                  "logit_bias") from None
    _require(all(len(p) == 2 for p in pairs), f"logit_bias must be (token id, bias) pairs, got {_short(pairs)}",
             "logit_bias")
    return tuple((int(t) if isinstance(t, str) and t.isascii() and t.isdigit() and len(t) <= 10 else t, b)
                 for t, b in pairs)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _short(value, limit: int = 80) -> str:
    """``value`` for an error message: huge integers by their size, long reprs cut."""
    if _is_int(value) and abs(value) >= 10**30:
        return f"{'-' if value < 0 else ''}<{value.bit_length()}-bit integer>"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise SamplingParamsError(message, param)
