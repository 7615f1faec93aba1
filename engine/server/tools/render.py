"""Tool calls in OpenAI's response shapes (called by ``server/chat.py``).

    message_fields(parser, text)      {"content": ..., "tool_calls": [...]} of a whole answer
    delta_fields(delta)               a stream chunk's ``delta``: content and/or ``tool_calls`` fragments -- a
                                      call's first fragment has its index, id, type and name (arguments ""
                                      or their start), the next ones its index and more arguments
    finish_reason(parser, reason)     "tool_calls" when the answer called a tool, closed every call it began and
                                      ended by itself (not cut by a stop string or max_tokens)
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.server.tools.parsers import CallDelta, ToolDelta, ToolOutputParser, parse_whole


def message_fields(parser: ToolOutputParser, text: str) -> dict[str, Any]:
    whole = parse_whole(parser, text)
    fields: dict[str, Any] = {"content": whole.content}
    if whole.calls:
        fields["tool_calls"] = [{"id": c.id, "type": "function",
                                 "function": {"name": c.name, "arguments": c.arguments}} for c in whole.calls]
    return fields


def delta_fields(delta: ToolDelta) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if delta.content:
        fields["content"] = delta.content
    if delta.calls:
        fields["tool_calls"] = [_call_fragment(c) for c in delta.calls]
    return fields


def _call_fragment(call: CallDelta) -> dict[str, Any]:
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {"index": call.index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def finish_reason(parser: ToolOutputParser | None, reason: str | None) -> str | None:
    done = parser is not None and parser.called and parser.complete
    return "tool_calls" if done and reason == "stop" else reason
