"""Request fields pdserve does not implement: the few it takes without effect, and why it refuses the others.

Nothing a client sends is accepted and then ignored. ``protocol.py`` builds its request models from these tables:

    class _Body(BaseModel): model_config = ConfigDict(extra="forbid")   # a field no table names: 400 naming it
    class _SamplingFields(_Body, NoEffect)              # NO_EFFECT: accepted (bounded), changes nothing
    class CompletionRequest(_SamplingFields, CompletionRefusals)   # REFUSED: a 400 naming the field and why,
    class ChatCompletionRequest(_SamplingFields, ChatRefusals)     # unless its value is null or asks for what
                                                                   # pdserve does anyway (``Refused.same``)

pydantic raises both refusals; ``errors.describe_validation_errors`` words them with ``refusal``:

    unknown field 'foo': pdserve does not support it (see docs/api-fields.md)
    field 'suffix' is not supported: pdserve has no fill-in-the-middle (see docs/api-fields.md)
    skip_special_tokens=false is not supported: ...; send true or leave it out (see docs/api-fields.md)

docs/api-fields.md lists the same fields; tests/test_api_fields.py walks every field of the ``openai`` client's
request types (and vLLM's extras) through a node and the proxy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, StringConstraints, ValidationInfo, create_model
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from pdserve.engine.server.text import check_json, check_text

DOC = "docs/api-fields.md"
REFUSED_TYPE = "unsupported_field"     # the pydantic error type of a refused value (``extra_forbidden``: unknown)
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512     # OpenAI's limits
MAX_ID_CHARS = 256                     # user, prompt_cache_key, service_tier
MAX_SAFETY_ID_CHARS = 128              # OpenAI's


def _string(limit: int):
    return Annotated[str, StringConstraints(max_length=limit), BeforeValidator(check_text)]


def _metadata_size(value):
    if isinstance(value, dict) and len(value) > MAX_METADATA_KEYS:
        raise ValueError(f"has {len(value)} keys; the limit is {MAX_METADATA_KEYS}")
    return value


Metadata = Annotated[dict[_string(MAX_METADATA_KEY_CHARS), _string(MAX_METADATA_VALUE_CHARS)],
                     Field(max_length=MAX_METADATA_KEYS), BeforeValidator(_metadata_size)]


class NoEffect(BaseModel):
    """OpenAI fields that change nothing pdserve computes or returns: accepted when well-formed (each field's
    description, also in the OpenAPI schema and docs/api-fields.md, says why)."""
    user: _string(MAX_ID_CHARS) | None = Field(None, description=(
        "an end-user id for OpenAI's abuse monitoring; pdserve monitors no users (the proxy's API keys name tenants)"))
    safety_identifier: _string(MAX_SAFETY_ID_CHARS) | None = Field(None, description=(
        "the same, under its newer name"))
    metadata: Metadata | None = Field(None, description=(
        "tags OpenAI stores with a completion (with store); pdserve stores no completions"))
    store: bool | None = Field(None, description=(
        "asks OpenAI to keep the completion for its dashboard and evals; pdserve keeps no completions"))
    prompt_cache_key: _string(MAX_ID_CHARS) | None = Field(None, description=(
        "routes OpenAI requests to a warm cache; pdserve's prefix cache and the proxy's prefix-aware routing "
        "match prompts by their tokens"))
    service_tier: _string(MAX_ID_CHARS) | None = Field(None, description=(
        "OpenAI's price and latency tier; a pdserve node has one tier"))


NO_EFFECT: dict[str, str] = {name: field.description or "" for name, field in NoEffect.model_fields.items()}


@dataclass(frozen=True)
class Refused:
    """A known field pdserve does not implement: ``reason`` says so; ``same`` are the values that ask for what
    pdserve does anyway (accepted, as null always is)."""
    reason: str
    same: tuple = ()


_OPENAI_CHAT = {
    "audio": Refused("pdserve generates text only"),
    "modalities": Refused("pdserve generates text only", same=(["text"],)),
    "prediction": Refused("pdserve has no predicted outputs (speculative decoding)"),
    "reasoning_effort": Refused("pdserve has no reasoning budget; the model's template decides"),
    "verbosity": Refused("pdserve does not steer answer length; use max_tokens"),
    "web_search_options": Refused("pdserve has no web search"),
    "moderation": Refused("pdserve moderates nothing"),
    "functions": Refused("deprecated by OpenAI; use tools / tool_choice"),
    "function_call": Refused("deprecated by OpenAI; use tools / tool_choice"),
    "prompt_cache_retention": Refused("pdserve's prefix cache keeps blocks while memory allows; no retention policy"),
    "prompt_cache_options": Refused("pdserve's prefix cache has no breakpoints or lifetimes to set"),
}
_VLLM = {
    "use_beam_search": Refused("pdserve samples; it has no beam search", same=(False,)),
    "length_penalty": Refused("only beam search uses it", same=(1.0,)),
    "truncate_prompt_tokens": Refused("pdserve does not truncate prompts; a prompt over --max-model-len is a 400"),
    "allowed_token_ids": Refused("not implemented; logit_bias -100 bans tokens"),
    "bad_words": Refused("not implemented; logit_bias -100 bans single tokens", same=([],)),
    "priority": Refused("pdserve schedules first come, first served", same=(0,)),
    "skip_special_tokens": Refused("generated text never shows special tokens", same=(True,)),
    "spaces_between_special_tokens": Refused("generated text never shows special tokens", same=(True,)),
    "logits_processors": Refused("pdserve runs no custom logits processors", same=([],)),
    "return_tokens_as_token_ids": Refused("logprobs name tokens by their text", same=(False,)),
    "return_token_ids": Refused("answers carry no token ids", same=(False,)),
    "vllm_xargs": Refused("pdserve takes no vLLM plug-in arguments", same=({},)),
    "request_id": Refused("pdserve names requests itself"),
    "guided_decoding_backend": Refused("pdserve's structured outputs always use xgrammar", same=("xgrammar",)),
    "guided_whitespace_pattern": Refused("not implemented; a JSON schema's output uses xgrammar's whitespace"),
}
CHAT_REFUSED: dict[str, Refused] = {
    **_OPENAI_CHAT, **_VLLM,
    "add_special_tokens": Refused("the chat template writes the special tokens; pdserve adds none", same=(False,)),
    "continue_final_message": Refused("pdserve starts a new message", same=(False,)),
    "chat_template": Refused("pdserve uses the model's chat template"),
    "chat_template_kwargs": Refused("pdserve passes the template nothing but messages", same=({},)),
    "documents": Refused("pdserve passes the template nothing but messages"),
    "mm_processor_kwargs": Refused("pdserve serves text-only models"),
}
COMPLETION_REFUSED: dict[str, Refused] = {
    **_VLLM,
    "suffix": Refused("pdserve has no fill-in-the-middle"),
    "add_special_tokens": Refused("a text prompt is encoded with the tokenizer's special tokens", same=(True,)),
    "prompt_embeds": Refused("pdserve takes prompts as text or token ids"),
}
STREAM_OPTIONS_REFUSED: dict[str, Refused] = {
    "include_obfuscation": Refused("pdserve does not pad stream events", same=(False,)),
    "continuous_usage_stats": Refused("usage comes once, in the last chunk (include_usage)", same=(False,)),
}
BEST_OF_REASON = "pdserve returns every choice it samples (best_of = n); it does not rank extra ones"
REFUSED: dict[str, Refused] = {**CHAT_REFUSED, **COMPLETION_REFUSED}     # for reasons; endpoints differ in ``same``


def _json(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_same(value: Any, other: Any) -> bool:
    """JSON equality (``1`` equals ``1.0``) that tells booleans from numbers (``True`` is not ``1``)."""
    if isinstance(value, bool) or isinstance(other, bool):
        return type(value) is type(other) and value == other
    return value == other


def _sends(same: tuple) -> str:
    return "send " + " or ".join(_json(v) for v in same) + " or leave it out" if same else "leave it out"


def refused_value(name: str, value: Any, refused: Refused) -> str:
    """The message refusing ``value`` of the known field ``name``."""
    if not refused.same:
        return f"field '{name}' is not supported: {refused.reason} (see {DOC})"
    return f"{name}={_json(value)} is not supported: {refused.reason}; {_sends(refused.same)} (see {DOC})"


def unknown_field(path: tuple[str, ...]) -> str:
    """The message refusing a field the model does not declare: its reason when a table knows the name."""
    name = ".".join(path)
    if (known := _known(path)) is not None:
        return f"field '{name}' is not supported: {known.reason} (see {DOC})"
    return f"unknown field '{name}': pdserve does not support it (see {DOC})"


def _known(path: tuple[str, ...]) -> Refused | None:
    """The table entry of ``path`` (one endpoint's field sent to the other finds its reason too)."""
    if len(path) == 1:
        return REFUSED.get(path[0])
    return STREAM_OPTIONS_REFUSED.get(path[1]) if len(path) == 2 and path[0] == "stream_options" else None


def refusal(error: dict[str, Any], path: tuple[str, ...]) -> str | None:
    """``errors``' wording of a pydantic error that refuses a field (at ``path``: its location, without FastAPI's
    "body" or union branch names); None for any other error."""
    if error.get("type") == "extra_forbidden":
        return unknown_field(path)
    if error.get("type") == REFUSED_TYPE:
        return error["msg"]
    return None


def _check(name: str, refused: Refused):
    def check(value: Any) -> None:
        if value is None or any(_is_same(value, same) for same in refused.same):
            return None                       # what pdserve does anyway: nothing to keep
        raise PydanticCustomError(REFUSED_TYPE, refused_value(name, check_json(value), refused))
    return check


def _refusals(model_name: str, table: dict[str, Refused], prefix: str = "") -> type[BaseModel]:
    """A model declaring each field of ``table`` (hidden from the OpenAPI schema: no value does anything)."""
    declared = {name: (SkipJsonSchema[Annotated[Any, AfterValidator(_check(prefix + name, refused))]],
                       Field(None, description=refused.reason)) for name, refused in table.items()}
    return create_model(model_name, __doc__=f"Refused fields: {', '.join(table)}.", **declared)


ChatRefusals = _refusals("ChatRefusals", CHAT_REFUSED)
CompletionRefusals = _refusals("CompletionRefusals", COMPLETION_REFUSED)
StreamOptionsRefusals = _refusals("StreamOptionsRefusals", STREAM_OPTIONS_REFUSED, "stream_options.")


def check_best_of(value: int | None, info: ValidationInfo) -> int | None:
    """``best_of`` (vLLM takes it on both endpoints): null or ``n``, which is what pdserve does (validated after
    ``n``; with a bad ``n`` the ``n`` error is the one reported)."""
    n = info.data.get("n")
    if value is None or n is None or value == n:
        return value
    raise PydanticCustomError(REFUSED_TYPE, f"best_of={value} with n={n} is not supported: {BEST_OF_REASON}; "
                                            f"send best_of={n} or leave it out (see {DOC})")
