"""``StructuredOutputs``: what a request's output must match -- one JSON schema, regex, choice list or grammar.

Built by the HTTP server from the OpenAI / vLLM request fields; carried on ``SamplingParams.structured`` to the
engine core (msgspec encodes it like the rest of ``SamplingParams``). Exactly one constraint is set. ``key``
names it for the compiled-grammar cache: the same constraint, however it was spelled, compiles once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None              # a JSON schema, as JSON text
    json_object: bool = False            # any JSON object (response_format {"type": "json_object"})
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None           # an EBNF grammar (xgrammar's / GBNF syntax)

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None) \
            if not self.json_object else "json_object"

    @property
    def key(self) -> str:
        """sha256 of the constraint in a canonical form (a schema's keys sorted): the compile cache's key."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = json.dumps(json.loads(value), sort_keys=True, separators=(",", ":"))
        text = json.dumps([self.kind, value], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()
