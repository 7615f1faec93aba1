"""A request's structured-output fields as one ``StructuredOutputs``, checked at the edge (node and proxy alike).

    spec = structured_outputs(body)          # protocol.to_sampling_params: None or the constraint; a 400 naming
                                             # the field when two are given or one is malformed
    await check_structured(body, prompts)    # the node's handlers and the proxy's admit_request: xgrammar parses
                                             # it in a worker thread (``PromptWork.run``); a bad schema, regex or
                                             # grammar is a 400 naming the field, before any engine sees it

The fields, of which a request may give at most one:

    response_format {"type": "json_object"}                          any JSON object
    response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"}   vLLM's
    guided_json | guided_regex | guided_choice | guided_grammar                   vLLM's older names
    tool_choice "required" or a named function                     the tools' schemas (``tools/plan.py``)

A JSON schema may come as an object or as JSON text. Constraints that passed are remembered by ``spec.key``
(the last ``VALID_CACHE_SIZE``), so a client repeating its schema pays for the check once.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from pdserve.engine.server.errors import bad_request
from pdserve.engine.server.limits import json_depth
from pdserve.engine.structured.grammar import StructuredOutputError, build_grammar
from pdserve.engine.server.tools.plan import ToolPlan
from pdserve.engine.structured.spec import StructuredOutputs

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
VALID_CACHE_SIZE = 1024
MAX_SPEC_CHARS = 1 << 16          # a regex, grammar or JSON schema (as JSON text: an object once written out)
MAX_SCHEMA_DEPTH = 32             # [ and { nesting of a schema (xgrammar's conversion time grows steeply with
                                  # it: 100 levels of array items take 0.1 s, 500 levels 12 s)
_valid: OrderedDict[str, None] = OrderedDict()   # keys of constraints that parsed (event loop only)


def structured_outputs(body) -> StructuredOutputs | None:
    found = structured_source(body)
    return None if found is None else found[0]


def structured_source(body) -> tuple[StructuredOutputs, str] | None:
    """(constraint, the field it came from), or None; a 400 if more than one field sets one."""
    found = []
    if body.response_format is not None and body.response_format.type != "text":
        found.append(_from_response_format(body.response_format))
    if body.structured_outputs is not None:
        found.append(_from_params(body.structured_outputs))
    for name in GUIDED:
        value = getattr(body, name)
        if value is not None:
            found.append((_spec(name.removeprefix("guided_"), value, name), name))
    if (schema := ToolPlan.of(body).forced_schema()) is not None:
        found.append((_spec("json", schema, "tool_choice"), "tool_choice"))
    if len(found) > 1:
        fields = ", ".join(param for _, param in found)
        raise bad_request(f"a request takes one structured-output constraint; got {fields}", found[1][1])
    return found[0] if found else None


async def check_structured(body, prompts) -> None:
    """Parse the request's constraint with xgrammar in a worker thread; 400 naming the field if it does not."""
    found = structured_source(body)
    if found is None:
        return
    spec, param = found
    key = spec.key
    if key in _valid:
        _valid.move_to_end(key)
        return
    try:
        await prompts.run(param, lambda: build_grammar(spec), doing="checking")
    except StructuredOutputError as exc:
        raise bad_request(f"{param}: {exc}", param) from None
    _valid[key] = None
    while len(_valid) > VALID_CACHE_SIZE:
        _valid.popitem(last=False)


def _from_response_format(fmt) -> tuple[StructuredOutputs, str]:
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True), "response_format"
    param = "response_format.json_schema.schema"
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema", param)
    return _spec("json", fmt.json_schema.schema_, param), param


def _from_params(params) -> tuple[StructuredOutputs, str]:
    given = {name: getattr(params, attr) for name, attr in
             (("json", "json_"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar"))
             if getattr(params, attr) is not None}
    if params.json_object:
        given["json_object"] = True
    if len(given) != 1:
        raise bad_request(f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                          f"got {sorted(given) or 'none'}", "structured_outputs")
    [(kind, value)] = given.items()
    param = f"structured_outputs.{kind}"
    return (_spec(kind, value, param) if kind != "json_object" else StructuredOutputs(json_object=True)), param


def _spec(kind: str, value, param: str) -> StructuredOutputs:
    if kind == "json":
        return StructuredOutputs(json=_schema_text(value, param))
    if kind == "choice":
        return StructuredOutputs(choice=tuple(value))
    return StructuredOutputs(**{kind: value})


def _schema_text(schema, param: str) -> str:
    """A JSON schema as JSON text (an object written out, a string checked to be JSON), bounded in size and
    nesting."""
    text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
    if len(text) > MAX_SPEC_CHARS:
        raise bad_request(f"{param} has {len(text)} characters as JSON; the limit is {MAX_SPEC_CHARS}", param)
    depth = json_depth(text.encode())
    if depth > MAX_SCHEMA_DEPTH:
        raise bad_request(f"{param} nests {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}", param)
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
    return text
