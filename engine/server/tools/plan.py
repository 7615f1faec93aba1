"""``ToolPlan``: what a chat request's ``tools`` and ``tool_choice`` ask of the server, checked at the edge.

    plan = ToolPlan.of(body)          # a 400 naming the field: tool_choice without tools, an unknown or repeated
                                      # function name
    plan.check(config)                # a 400 for "auto" on a server without --enable-auto-tool-choice
    plan.template_tools               # what the chat template gets as ``tools`` (None: no tools)
    plan.forced_schema()              # required / named: the JSON schema the output must follow, else None
    plan.parser(config)               # the output parser of one choice (parsers.py), None: plain content

The modes (``tool_choice``; with tools and no ``tool_choice``, "auto", as OpenAI and vLLM default):

    none       the tools are shown to the model (the template gets them) but the answer is plain content
    auto       the model decides; its output is read by --tool-call-parser
    required   one call or more: the output is a JSON array ``[{"name": ..., "parameters": {...}}, ...]`` whose
               items follow the tools' schemas (``maxItems`` 1 when ``parallel_tool_calls`` is false); each tool's
               schema sits in the combined schema's ``$defs``, its ``$ref`` pointers rebased there
    named      exactly that function: the output is its arguments, following its ``parameters`` schema

A forced mode is a structured-output constraint like ``response_format`` (``server/structured.py`` turns the schema
into ``StructuredOutputs``), so the prefill node samples the first token under it and the decode node goes on
under it; a request with both is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.engine.server.errors import bad_request
from pdserve.engine.server.tools.config import ToolConfig
from pdserve.engine.server.tools.parsers import (HermesParser, Llama3JsonParser, NamedParser, RequiredParser,
                                                 ToolOutputParser, new_call_id)

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: str                                  # none | auto | required | named
    tools: tuple[Any, ...] = ()                # the request's Tool models
    name: str | None = None                    # named: the function
    parallel: bool = True                      # parallel_tool_calls

    @classmethod
    def of(cls, body) -> "ToolPlan":
        tools, choice = tuple(getattr(body, "tools", None) or ()), getattr(body, "tool_choice", None)
        parallel = getattr(body, "parallel_tool_calls", None) is not False
        if not tools:
            if choice not in (None, "none"):
                raise bad_request(f"tool_choice {_choice_text(choice)} needs tools; the request has none",
                                  "tool_choice")
            return cls("none", parallel=parallel)
        _check_names(tools)
        if choice is None or isinstance(choice, str):
            return cls(choice or "auto", tools, parallel=parallel)
        name = choice.function.name
        if name not in {t.function.name for t in tools}:
            raise bad_request(f"tool_choice names function {name!r}, which is not among the request's tools "
                              f"({', '.join(t.function.name for t in tools)})", "tool_choice")
        return cls("named", tools, name, parallel)

    def check(self, config: ToolConfig) -> None:
        if self.mode == "auto" and not config.auto:
            raise bad_request('tool_choice "auto" (the default when a request has tools) needs a server started '
                              'with --enable-auto-tool-choice and --tool-call-parser; send tool_choice "required", '
                              'a named function or "none"', "tool_choice")

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template expects them (transformers passes OpenAI's shape through)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def forced_schema(self) -> dict[str, Any] | None:
        if self.mode == "named":
            return _parameters(next(t for t in self.tools if t.function.name == self.name))
        if self.mode != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "parameters": {"$ref": f"#/$defs/{_tool_def(i)}"}},
                  "required": ["name", "parameters"]} for i, t in enumerate(self.tools)]
        defs = {_tool_def(i): _rebase(_parameters(t), f"#/$defs/{_tool_def(i)}") for i, t in enumerate(self.tools)}
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items},
                  "$defs": defs}
        return schema if self.parallel else {**schema, "maxItems": 1}

    def parser(self, config: ToolConfig, ids=new_call_id) -> ToolOutputParser | None:
        """A new parser for one choice (``ids`` makes its calls' ids: ``parsers.call_id_factory``); under "auto",
        a call to a function outside the tools stays content."""
        names = frozenset(t.function.name for t in self.tools)
        if self.mode == "named":
            return NamedParser(self.name, ids)
        if self.mode == "required":
            return RequiredParser(names, self.parallel, ids)
        if self.mode == "auto":
            kind = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}[config.tool_call_parser]
            return kind(names, self.parallel, ids)
        return None


def _tool_def(index: int) -> str:
    return f"pdserve_tool_{index}"


def _rebase(schema: Any, root: str) -> Any:
    """``schema`` with every local ``$ref`` (``#``, ``#/$defs/X``, ``#/properties/...``) pointing under ``root``:
    each tool's schema moves to ``$defs`` of the combined one, and its own pointers must follow it."""
    if isinstance(schema, dict):
        return {k: (root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase(v, root))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase(v, root) for v in schema]
    return schema


def _parameters(tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS


def _check_names(tools) -> None:
    seen = set()
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            raise bad_request(f"tools[{i}] repeats the function name {tool.function.name!r}",
                              f"tools.{i}.function.name")
        seen.add(tool.function.name)


def _choice_text(choice) -> str:
    return json.dumps(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
