"""Strings and free-form JSON a request may carry: Unicode text only, finite numbers only.

Used by ``protocol``, whose request models are the node's and the proxy's alike: every string field's type
runs ``check_text`` first (``Text``, ``Name``, ``StopString``, logit_bias keys), every free-form value -- ``kv_transfer_params``,
a message's ``name`` / ``tool_calls``, ``user``, any unknown field, all of which the proxy forwards to a node --
is checked by ``check_json`` (recursing into lists and dicts, keys included); a field name that is not
Unicode text pydantic refuses itself (``errors`` words its message with ``text_problem``). A failure is a
pydantic error on that field, so the client gets a 400 naming it.

Why: JSON can spell a lone UTF-16 surrogate (``"\\ud800"``, or a raw ``ED A0 80`` that ``json.loads`` decodes
with ``surrogatepass``), and Python keeps it in a ``str``; but no UTF-8 encoder takes it -- not the tokenizer
(Rust strings: a 500 ``TextEncodeInput must be ...``), not the chat template's output, not the proxy's body
to a node (``upstream.encode_json``: a 500 there while the node answered 200), not a JSON response. Free-form
values are refused NaN and Infinity too, which ``json.loads`` takes but strict JSON (the proxy's body to a
node) cannot carry. A body that passes these checks always serialises.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic_core import PydanticCustomError

_SURROGATE = re.compile("[\ud800-\udfff]")


def text_problem(text: str) -> str | None:
    """Why ``text`` is not Unicode text (its first lone surrogate and where), or None (the common case:
    an ASCII check, then one regex scan)."""
    if text.isascii():
        return None
    found = _SURROGATE.search(text)
    if found is None:
        return None
    return (f"has a lone UTF-16 surrogate \\u{ord(found.group()):04x} at character {found.start()}, which is not "
            "Unicode text (send UTF-8, or \\u escapes that pair a high and a low surrogate)")


def check_text(value: Any) -> Any:
    """A pydantic before-validator: refuses a ``str`` that is not Unicode text; anything else passes on
    to the field's own type check."""
    if isinstance(value, str) and (problem := text_problem(value)) is not None:
        raise _error(problem)
    return value


def check_json(value: Any) -> Any:
    """A pydantic after-validator for free-form JSON: every string (keys too) Unicode text, every number
    finite, however deep. A walk without paths first; only a value that fails it is walked again to say where."""
    if _clean(value):
        return value
    where, problem = _first_problem(value)
    raise _error(f"{where.removeprefix('.')} {problem}" if where else problem)


def _clean(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if text_problem(item) is not None:
                return False
        elif isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            if any(isinstance(k, str) and text_problem(k) is not None for k in item):
                return False
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return True


def _first_problem(value: Any) -> tuple[str, str]:
    """(a path such as ``.tools[0].name``, the problem) of a value ``_clean`` refused."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str) and (problem := text_problem(item)) is not None:
            return path, problem
        if isinstance(item, float) and not math.isfinite(item):
            return path, f"is {item}; a JSON number must be finite"
        if isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and (problem := text_problem(key)) is not None:
                    return f"{path} key".lstrip(), f"{_escaped(key)} {problem}"
                stack.append((child, f"{path}.{key}"))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return "", "is not plain JSON"


def _escaped(text: str, limit: int = 60) -> str:
    """``text`` as a quoted ASCII-safe repr, cut short (an error message must itself be encodable)."""
    shown = repr(text[:limit])
    return shown if len(text) <= limit else shown + "..."


def _error(message: str) -> PydanticCustomError:
    return PydanticCustomError("unicode_text", "{reason}", {"reason": message})
