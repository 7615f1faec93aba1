"""Per-request sampling parameters (the OpenAI / vLLM knobs), validated once.

Built by the HTTP server (from a request body) or by users of ``LLM.generate``;
read by the sampler (``pdserve.engine.sampler``) and by the scheduler's stop checks.
"""

from __future__ import annotations

from dataclasses import dataclass


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the value and the limit."""


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
    min_tokens: int = 0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Accept lists from JSON; keep the dataclass hashable/frozen.
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._check()

    def _check(self) -> None:
        _require(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _require(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _require(self.top_k == -1 or self.top_k >= 0, f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        _require(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _require(self.repetition_penalty > 0.0,
                 f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _require(self.logprobs is None or 0 <= self.logprobs <= 20,
                 f"logprobs must be in [0, 20], got {self.logprobs}")
        _require(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _require(all(isinstance(s, str) and s for s in self.stop),
                 f"stop strings must be non-empty strings, got {list(self.stop)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise SamplingParamsError(message)
