"""A ``StructuredOutputs`` as an xgrammar ``Grammar``: the vocabulary-free half of compiling it.

Called by the HTTP edge (``server/structured.py``, in a worker thread: a bad schema, regex or grammar is a 400
naming the field before the request reaches the engine) and by the engine core's compiler (``compiler.py``,
which then compiles the grammar against the model's vocabulary):

    grammar = build_grammar(spec)          # raises StructuredOutputError naming what is wrong

What each kind means:

    json         the JSON schema, strictly (no properties or items beyond the schema's: xgrammar's strict mode,
                 which is also what ``strict: true`` asks for), compact: one space after ``,`` and ``:``, no other
                 whitespace (a model cannot spend its tokens on blank lines)
    json_object  any JSON object, with the same whitespace
    regex        the regular expression (xgrammar's dialect: ECMAScript-like, no lookaround / backreferences)
    choice       exactly one of the strings
    grammar      an EBNF grammar in xgrammar's / GBNF syntax, starting at rule ``root``
"""

from __future__ import annotations

import json
import re

from pdserve.engine.structured.spec import StructuredOutputs

JSON_OBJECT_SCHEMA = '{"type": "object"}'
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:[0-9]+: (Check failed: \(.*?\) is false: )?")
_LOOSE_CHAR = r'[^\"\\\r\n]'                                     # what xgrammar writes
_JSON_CHAR = r'[^\0-\x1f\"\\]'                                    # a JSON string's unescaped character
KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
              "grammar": "EBNF grammar"}


class StructuredOutputError(ValueError):
    """The constraint cannot be compiled; the message names its kind and xgrammar's reason."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"invalid {KIND_NAMES.get(kind, kind)}: {reason}")
        self.kind, self.reason = kind, reason


def build_grammar(spec: StructuredOutputs):
    """The xgrammar ``Grammar`` of ``spec`` (no vocabulary needed: fast, ~1 ms for an ordinary schema)."""
    import xgrammar as xgr

    try:
        if spec.json is not None or spec.json_object:
            return _json_schema_grammar(spec.json if spec.json is not None else JSON_OBJECT_SCHEMA)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise StructuredOutputError(spec.kind, _reason(exc)) from None


def _json_schema_grammar(schema: str):
    r"""xgrammar's grammar of ``schema``, with its length-bounded strings mended: xgrammar (0.2.9; its issue
    #800) writes a string with ``minLength`` / ``maxLength`` as a repetition of ``[^"\\\r\n]``, which admits raw
    control characters (a tiny model emits them: the document is then not JSON). Such a grammar is printed as
    EBNF, that class made ``[^\0-\x1f"\\]`` (still a character class: xgrammar's bounded repetition of one is
    fast, while one of an escape-or-character rule made a mask take 20 ms), and parsed again. Escapes stay out of
    such strings, as in xgrammar.
    """
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    text = str(grammar)                      # ~0.5 ms for 300 properties (the conversion took 10)
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHAR, _JSON_CHAR)) if _LOOSE_CHAR in text else grammar


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """``root ::= "a" | "b"``: each choice a string literal (JSON's escapes are xgrammar's)."""
    if not choices:
        raise ValueError("choice needs at least one string")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location and check expression, on one line."""
    text = str(exc).strip()
    text = _NATIVE_PREFIX.sub("", text)
    return " ".join(text.split())[:500] or type(exc).__name__
