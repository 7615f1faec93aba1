"""The tool fields of a chat request, as OpenAI sends them, bounded like every other field (``server/protocol``).

    tools                 [{"type": "function", "function": {"name", "description", "parameters", "strict"}}]
    tool_choice           "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls   false: at most one call per answer
    messages[i].tool_calls   an assistant's earlier calls: [{"id", "type": "function", "function": {"name",
                             "arguments": JSON text}}]
    messages[i].tool_call_id a ``tool`` message's answer to one of them

A function name follows OpenAI's rule (``^[a-zA-Z0-9_-]{1,64}$``); ``parameters`` is a JSON schema object (checked
by xgrammar when a forced choice compiles it: ``plan.py``). Unknown keys in a tool or ``tool_choice`` are refused;
an earlier call in the messages keeps its other keys (clients echo back what they were sent; the chat template
gets them as is).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from pdserve.engine.server.text import check_json, check_text

MAX_TOOLS = 128                 # OpenAI's limit on functions per request
MAX_TOOL_CALLS = 128            # earlier calls in one assistant message
MAX_DESCRIPTION_CHARS = 1 << 16
MAX_ARGUMENTS_CHARS = 1 << 20   # one earlier call's arguments, as JSON text
MAX_CALL_ID_CHARS = 256
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"

FunctionName = Annotated[str, StringConstraints(pattern=FUNCTION_NAME), BeforeValidator(check_text)]
Description = Annotated[str, StringConstraints(max_length=MAX_DESCRIPTION_CHARS), BeforeValidator(check_text)]
Schema = Annotated[dict[str, Any], AfterValidator(check_json)]
CalledName = Annotated[str, StringConstraints(max_length=MAX_CALL_ID_CHARS), BeforeValidator(check_text)]
CallId = Annotated[str, StringConstraints(max_length=MAX_CALL_ID_CHARS), BeforeValidator(check_text)]
Arguments = Annotated[str, StringConstraints(max_length=MAX_ARGUMENTS_CHARS), BeforeValidator(check_text)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Function(_Strict):
    name: FunctionName
    description: Description | None = None
    parameters: Schema | None = None
    strict: bool | None = None          # accepted: a forced call always follows the schema strictly


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class FunctionRef(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionRef


def _choice_word(value):
    """A string ``tool_choice`` is one of the three words (a 400 naming ``tool_choice`` and the three, not a union
    branch); an object goes on to ``NamedToolChoice``."""
    if isinstance(value, str) and value not in CHOICE_WORDS:
        raise ValueError(f"is {value[:40]!r}; use one of {', '.join(CHOICE_WORDS)} or "
                         '{"type": "function", "function": {"name": ...}}')
    return value


CHOICE_WORDS = ("none", "auto", "required")
ToolChoice = Annotated[Union[Literal["none", "auto", "required"], NamedToolChoice], BeforeValidator(_choice_word)]
Tools = Annotated[list[Tool], Field(max_length=MAX_TOOLS)]


class CalledFunction(BaseModel):
    """An earlier call's function: its name as the server wrote it (an "auto" call's name is the model's text,
    so any bounded text, not only ``FUNCTION_NAME``: the client sends back what it got)."""
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Annotated[Any, AfterValidator(check_json)]] = Field(init=False)
    name: CalledName
    arguments: Arguments


class ToolCall(BaseModel):
    """An earlier call, as the client got it (and sends it back with the ``tool`` message that answers it)."""
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Annotated[Any, AfterValidator(check_json)]] = Field(init=False)
    id: CallId | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


ToolCalls = Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)]
