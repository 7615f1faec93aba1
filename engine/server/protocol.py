"""Request bodies of the node's HTTP API (OpenAI + the vLLM extras), validated by pydantic.

Parsed by FastAPI for ``completions.py``, ``chat.py`` and ``app.py``; ``to_sampling_params``
turns the shared sampling fields into a ``SamplingParams`` (which checks the ranges).
Responses are plain dicts built next to their handlers: their shape is the OpenAI one.
Unknown fields are ignored, like OpenAI and vLLM do; known-but-unsupported ones that would
change the output (``echo``, penalties other than repetition) are rejected, not ignored.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.server.errors import bad_request

Prompt = Union[str, list[int], list[str], list[list[int]]]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat; defaults follow the OpenAI API."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # pdserve P/D extensions (set by the proxy): token ids to use instead of re-tokenizing (one prompt,
    # or one list per prompt), and the KV hand-off (see pdserve.engine.kv_transfer; a list: one per prompt)
    prompt_token_ids: list[int] | list[list[int]] | None = None
    kv_transfer_params: dict[str, Any] | list[dict[str, Any] | None] | None = None

    def unsupported(self) -> str | None:
        """A message naming a field we would otherwise silently ignore, or None."""
        if self.presence_penalty or self.frequency_penalty:
            return ("presence_penalty and frequency_penalty are not supported (got "
                    f"{self.presence_penalty}, {self.frequency_penalty}); use repetition_penalty")
        return None

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises SamplingParamsError (-> 400 by errors.py) for out-of-range values."""
        knobs: dict[str, Any] = dict(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, seed=self.seed)
        knobs = {k: v for k, v in knobs.items() if v is not None}
        return SamplingParams(
            max_tokens=max_tokens, stop=tuple(_as_list(self.stop)), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logprobs=logprobs, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, **knobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo=true is not supported"
        return super().unsupported()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")   # name, tool_call_id ... go to the template as is

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise bad_request(f"top_logprobs={self.top_logprobs} needs logprobs=true", "top_logprobs")
            return None
        return self.top_logprobs or 0


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: either ``prompt`` or chat ``messages``."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def prompt_list(prompt: Prompt) -> list[str | list[int]]:
    """A completions ``prompt`` as its list of prompts (text or token ids); the node and the proxy agree."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def _as_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template wants them; text parts joined, other parts rejected."""
    out = []
    for i, message in enumerate(messages):
        d = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            d["content"] = _text_of_parts(message.content, i)
        d.setdefault("content", "")
        out.append(d)
    return out


def _text_of_parts(parts: list[dict[str, Any]], index: int) -> str:
    texts = []
    for part in parts:
        if part.get("type") != "text":
            raise bad_request(f"messages[{index}] has a content part of type {part.get('type')!r}; "
                              "only 'text' parts are supported", f"messages.{index}.content")
        texts.append(str(part.get("text", "")))
    return "".join(texts)
