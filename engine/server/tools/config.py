"""``ToolConfig``: how a server reads tool calls it was not forced to make (``tool_choice`` "auto").

vLLM's flags, on ``pdserve node``, ``pdserve proxy`` and ``pdserve serve`` (which passes them on):

    --enable-auto-tool-choice      let the model decide whether to call a tool (``tool_choice`` "auto", the default
                                   when a request has tools); without it such a request is a 400, as in vLLM
    --tool-call-parser NAME        how its output is read: hermes (Qwen2.5 / Qwen3 / Hermes ``<tool_call>{...}
                                   </tool_call>``) or llama3_json (Llama 3.1+ ``{"name": ..., "parameters": ...}``)

``tool_choice`` "required" and a named function need neither: the output is constrained to the tools' JSON schemas.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ToolConfig:
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             f"{', '.join(TOOL_CALL_PARSERS)})")

    @property
    def auto(self) -> bool:
        return self.enable_auto_tool_choice


def add_tool_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="tool_choice 'auto' (the default with tools): the model decides; needs --tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                        help="how a tool call is read from the output under 'auto': hermes (Qwen <tool_call>) or "
                             "llama3_json")


def tool_config_from_args(args) -> ToolConfig:
    return ToolConfig(args.enable_auto_tool_choice, args.tool_call_parser)
