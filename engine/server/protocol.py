"""Request bodies of the node's HTTP API (OpenAI + the vLLM extras), typed and bounded by pydantic.

Parsed by FastAPI for ``completions.py``, ``chat.py`` and ``info.py`` -- and by the proxy's routes, so a
bad request gets the same 400 from the proxy as from a node, and the proxy never forwards it.
``checks.check_request`` then runs what needs the model (vocabulary size) and ``to_sampling_params``
turns the shared sampling fields into a ``SamplingParams`` (which checks the ranges).

Every field is bounded where it enters: integers to the width the engine uses (token ids and counts
to int32, ``seed`` to int64 so that ``seed + choice index`` still fits the generator), floats finite,
strings, lists and dicts to the lengths below; JSON nesting is bounded before parsing (``limits``).
Every string is Unicode text and every free-form value plain JSON (``text``: a lone surrogate is a 400
naming the field, not a 500 from the tokenizer or the proxy's encoder).
Structured outputs (``response_format``, ``structured_outputs``, ``guided_*``) become ``SamplingParams.structured``
through ``structured.py``, which refuses two at once and checks each with xgrammar.
Nothing is accepted and ignored (``fields.py``, docs/api-fields.md): an unknown field is a 400 naming it, in
nested objects too (a chat message's extra keys excepted: they go to the chat template as they are); a known field
pdserve does not implement is a 400 saying why, unless null or the value pdserve does anyway (``best_of`` = ``n``,
``skip_special_tokens`` true ...); ``user``, ``metadata``, ``store`` and a few more are taken without effect.
``echo`` and ``prompt_logprobs`` follow vLLM (``echo.py`` writes them): completions echo the prompt (``max_tokens``
0 too: the engine then samples one token nobody sees), chat echoes the last message when it has the answer's role;
``prompt_logprobs`` in [0, 20], not with ``stream`` (above 0). ``logit_bias`` keys are token ids as JSON strings
(digits; checked against the vocabulary by ``checks``), its values and the presence / frequency penalties are
range-checked by ``SamplingParams``.
Responses are plain dicts built next to their handlers: their shape is the OpenAI one.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from dataclasses import replace

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StringConstraints,
                      Tag)

from pdserve.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from pdserve.engine.server.errors import bad_request
from pdserve.engine.server.fields import (ChatRefusals, CompletionRefusals, NoEffect, StreamOptionsRefusals,
                                          check_best_of, unknown_field)
from pdserve.engine.server.structured import MAX_SPEC_CHARS, structured_outputs
from pdserve.engine.server.text import check_json, check_text
from pdserve.engine.server.tools.protocol import CallId, ToolCalls, ToolChoice, Tools

INT32_MAX, INT64_MIN, INT64_MAX = 2**31 - 1, -2**63, 2**63 - 1
MAX_N = 16                     # choices per prompt; seed + (n - 1) <= 2^63 + 14 < 2^64: the generator's range
MAX_PROMPTS = 64               # prompts in one completions request
MAX_CHOICES = 256              # prompts x n: engine requests one HTTP request may start
MAX_TOKEN_IDS = 1 << 20        # token ids in one prompt (more never fits a --max-model-len)
MAX_STOP = 64                  # stop strings; each at most MAX_STOP_CHARS
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256        # parts of one message's content
MAX_NAME_CHARS = 256           # model names, roles, part types
MAX_CACHE_SALT_CHARS = 256     # cache_salt: non-empty when given (vLLM), at most this long
MAX_CHOICE_STRINGS = 1024      # structured-output choices; each at most MAX_CHOICE_CHARS
MAX_CHOICE_CHARS = 1024


def _bounded(container, limit: int):
    """``container`` (a list or dict type) of at most ``limit`` items: the length is checked before the
    items are (a million-item list is refused at once, not after a million validations), validation
    stops at the first bad item, and the OpenAPI schema says ``maxItems`` / ``maxProperties``."""
    def check(value):
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise ValueError(f"has {len(value)} items; the limit is {limit}")
        return value
    return Annotated[container, Field(max_length=limit, fail_fast=True), BeforeValidator(check)]


Int = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]          # anything the engine compares
Count = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]       # token counts (sign checked by SamplingParams)
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]              # against the vocabulary: checks.py
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Float = Annotated[float, Field(allow_inf_nan=False)]             # JSON's NaN / Infinity / 1e999 refused
Text = Annotated[str, BeforeValidator(check_text)]                # Unicode text: no lone surrogate (``text``)
Name = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS), BeforeValidator(check_text)]
JSONValue = Annotated[Any, AfterValidator(check_json)]           # free-form: strings Text, numbers finite
JSONObject = Annotated[dict[str, Any], AfterValidator(check_json)]
TokenIds = _bounded(list[TokenId], MAX_TOKEN_IDS)
TokenIdLists = _bounded(list[TokenIds], MAX_PROMPTS)


def _prompt_kind(value: Any) -> str:
    """Which form of a prompt ``value`` is, judged by its first item, so that a bad prompt is reported
    against the form it is (the branch names are dropped from error paths by ``errors``)."""
    if not isinstance(value, list):
        return "str"
    first = value[0] if value else None
    return {str: "list[str]", list: "list[list[int]]"}.get(type(first), "list[int]")


def _ids_kind(value: Any) -> str:
    return "list[list[int]]" if isinstance(value, list) and value and isinstance(value[0], list) else "list[int]"


Prompt = Annotated[Union[Annotated[Text, Tag("str")], Annotated[TokenIds, Tag("list[int]")],
                         Annotated[_bounded(list[Text], MAX_PROMPTS), Tag("list[str]")],
                         Annotated[TokenIdLists, Tag("list[list[int]]")]], Discriminator(_prompt_kind)]
PromptIds = Annotated[Union[Annotated[TokenIds, Tag("list[int]")], Annotated[TokenIdLists, Tag("list[list[int]]")]],
                      Discriminator(_ids_kind)]
StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS), BeforeValidator(check_text)]
CacheSalt = Annotated[str, StringConstraints(min_length=1, max_length=MAX_CACHE_SALT_CHARS), BeforeValidator(check_text)]
SpecText = Annotated[str, StringConstraints(max_length=MAX_SPEC_CHARS), BeforeValidator(check_text)]
ChoiceText = Annotated[str, StringConstraints(max_length=MAX_CHOICE_CHARS), BeforeValidator(check_text)]
ChoiceList = Annotated[_bounded(list[ChoiceText], MAX_CHOICE_STRINGS), Field(min_length=1)]
LogitBias = _bounded(dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$"), BeforeValidator(check_text)],
                          Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]], MAX_LOGIT_BIAS)


class _Body(BaseModel):
    """Every request object: a field it does not name is a 400 naming it (``fields.unknown_field``); pydantic
    refuses a name that is not Unicode text."""
    model_config = ConfigDict(extra="forbid")


class _Open(_Body):
    """An object whose fields it does not name are kept (a message's go to the chat template) but must be plain
    JSON (``JSONValue``)."""
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JSONValue] = Field(init=False)


class StreamOptions(_Body, StreamOptionsRefusals):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    """``response_format.json_schema``: OpenAI's. ``strict`` is accepted: the output always follows the schema
    strictly (``engine/structured/grammar.py``)."""
    name: Name
    description: Text | None = None
    schema_: JSONObject | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(_Body):
    """vLLM's ``structured_outputs``: exactly one of these (its other fields are refused, as unknown ones are)."""
    json_: JSONObject | SpecText | None = Field(None, alias="json")
    regex: SpecText | None = None
    choice: ChoiceList | None = None
    grammar: SpecText | None = None
    json_object: bool | None = None


class _SamplingFields(_Body, NoEffect):
    """Fields shared by completions and chat; defaults follow the OpenAI API. ``NoEffect``'s are taken too."""

    model: Name | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: Annotated[Count | None, AfterValidator(check_best_of)] = None     # null or n (fields.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stop: StopString | _bounded(list[StopString], MAX_STOP) | None = None
    seed: Seed | None = None
    presence_penalty: Float | None = 0.0      # null as 0, as vLLM takes it
    frequency_penalty: Float | None = 0.0
    logit_bias: LogitBias | None = None
    # vLLM extras
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    stop_token_ids: _bounded(list[TokenId], MAX_STOP_TOKEN_IDS) | None = None
    include_stop_str_in_output: bool = False
    cache_salt: CacheSalt | None = None     # only requests with the same salt share prefix-cache blocks / store KV
    prompt_logprobs: Count | None = None    # each prompt token's logprob and this many top ones (SamplingParams: <= 20)
    echo: bool = False                      # completions: the prompt first; chat: the last message (vLLM's)
    # structured outputs (server/structured.py): OpenAI's response_format, vLLM's structured_outputs and the
    # older guided_* names; at most one of them
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: JSONObject | SpecText | None = None
    guided_regex: SpecText | None = None
    guided_choice: ChoiceList | None = None
    guided_grammar: SpecText | None = None
    # pdserve P/D extensions (set by the proxy): token ids to use instead of re-tokenizing (one prompt,
    # or one list per prompt), and the KV hand-off (see pdserve.engine.kv.kv_transfer; a list: one per prompt)
    prompt_token_ids: PromptIds | None = None
    kv_transfer_params: JSONObject | _bounded(list[JSONObject | None], MAX_PROMPTS) | None = None

    def unsupported(self) -> str | None:
        """A message naming a field we would otherwise silently ignore, or None."""
        return None

    @property
    def logit_bias_ids(self) -> list[int]:
        return [int(t) for t in self.logit_bias or ()]

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises SamplingParamsError (-> 400 by errors.py) for out-of-range values."""
        knobs: dict[str, Any] = dict(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias)
        knobs = {k: v for k, v in knobs.items() if v is not None}
        return SamplingParams(
            max_tokens=max_tokens, stop=tuple(_as_list(self.stop)), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logprobs=logprobs, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured=structured_outputs(self), **knobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _streamed_prompt_logprobs(self) -> str | None:
        """vLLM refuses prompt logprobs it could not show: a stream has no place for them."""
        if self.stream and self.prompt_logprobs:
            return f"prompt_logprobs are not available when stream=true (got prompt_logprobs={self.prompt_logprobs})"
        return None


class CompletionRequest(_SamplingFields, CompletionRefusals):
    prompt: Prompt
    max_tokens: Count | None = 16
    logprobs: Count | None = None

    def unsupported(self) -> str | None:
        return self._streamed_prompt_logprobs() or super().unsupported()

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """vLLM's: ``max_tokens`` 0 with ``echo`` runs one token (not shown); ``echo`` with ``logprobs`` asks for
        that many prompt logprobs unless ``prompt_logprobs`` says how many."""
        params = super().to_sampling_params(1 if self.echo_only else max_tokens, logprobs)
        prompt = self.prompt_logprobs if self.prompt_logprobs is not None else self.logprobs if self.echo else None
        return params if prompt is None else replace(params, prompt_logprobs=prompt)

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the answer is the prompt, nothing generated (lm-eval's loglikelihood)."""
        return self.echo and self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompts(self) -> int:
        return len(prompt_list(self.prompt))


class ContentPart(_Open):
    """One part of a message's content; only ``text`` parts are supported (others are refused by their type,
    a text part's unknown keys by name: ``message_dicts``)."""
    type: Name
    text: Text | None = None


class ChatMessage(_Open):
    """Extra fields (name, reasoning_content ...) go to the template as is; an assistant's ``tool_calls`` go with
    their arguments as objects (``message_dicts``), as chat templates expect them."""
    role: Name
    content: Text | _bounded(list[ContentPart], MAX_CONTENT_PARTS) | None = None
    tool_calls: ToolCalls | None = None
    tool_call_id: CallId | None = None


Messages = Annotated[_bounded(list[ChatMessage], MAX_MESSAGES), Field(min_length=1)]


class ChatCompletionRequest(_SamplingFields, ChatRefusals):
    messages: Messages
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    add_generation_prompt: bool = True
    # tool calling (server/tools): the template sees the tools; required / a named function constrain the output
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> str | None:
        return self._streamed_prompt_logprobs() or super().unsupported()

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        params = super().to_sampling_params(max_tokens, logprobs)
        return params if self.prompt_logprobs is None else replace(params, prompt_logprobs=self.prompt_logprobs)

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

    @property
    def num_prompts(self) -> int:
        return 1


class TokenizeRequest(_Body):
    """vLLM's /tokenize: either ``prompt`` or chat ``messages``. ``add_special_tokens``: null is true for a prompt;
    with messages only false (the template writes them: ``info.tokenize`` refuses true)."""
    model: Name | None = None
    prompt: Text | None = None
    messages: Messages | None = None
    tools: Tools | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False         # each token's vocabulary entry in ``token_strs``


class DetokenizeRequest(_Body):
    model: Name | None = None
    tokens: TokenIds


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
        if message.tool_calls:
            d["tool_calls"] = [_call_for_template(call) for call in d["tool_calls"]]
        out.append(d)
    return out


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier call with its ``arguments`` as an object when they are one (templates write them with
    ``tojson``; vLLM does the same), else as the text the client sent."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except (ValueError, RecursionError):
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**call["function"], "arguments": arguments}}


def _text_of_parts(parts: list[ContentPart], index: int) -> str:
    texts = []
    for j, part in enumerate(parts):
        if part.type != "text":
            raise bad_request(f"messages[{index}] has a content part of type {part.type!r}; "
                              "only 'text' parts are supported", f"messages.{index}.content")
        if part.model_extra:
            path = ("messages", str(index), "content", str(j), next(iter(part.model_extra)))
            raise bad_request(unknown_field(path), ".".join(path))
        texts.append(part.text or "")
    return "".join(texts)
