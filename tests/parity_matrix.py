"""The request matrix of the P/D parity suite (test_pd_parity.py) and how two answers are compared.

``cases(base)`` builds every request body from a ``Baseline``: the colocated node's greedy texts after
k tokens and the greedy token ids, from which the stop strings and stop ids are cut (a stop string
is chosen so that its first occurrence ends where the case wants it: inside the first token, across
tokens 2-3, on the last allowed token), and the logit_bias ids picked. The penalty cases make the
prefill node's first token count: a bias pushes it to repeat and the penalty stops it -- a decode node
that did not count it would answer differently.
``differences(a, b)`` compares two answers field by field, ids and timestamps aside, floats (logprobs) to 1e-3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
# With the Metaspace model these make greedy outputs that start with "▁word" pieces and hold byte tokens
# (partial UTF-8), the cases where detokenization differs between tokenizer kinds.
PROMPTS = {CMPL: "The quiet engineer politely asked about the server logs in 1999.",
           CHAT: [{"role": "user", "content": "Every student never forgot three green apples before noon."}]}
SECOND_PROMPT = "Her younger brother bravely crossed the winter garden before noon."
CONTINUE = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris is the capital"}]
TEXT_LENGTHS = (1, 2, 3, 6, 8)           # baseline texts after k greedy tokens
# structured outputs (issue 37): the prefill node samples the first token under the constraint, the decode node's
# matcher accepts it before its first sample
STRUCTURED = ("json-schema", "json-schema-seeded-n2", "json-object-logprobs", "regex", "choice-seeded", "grammar",
              "guided-json-stop-string")
SCHEMA = {"type": "object", "required": ["name", "size", "kind", "tags", "where"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "size": {"type": "integer", "maximum": 999},
                         "kind": {"enum": ["small", "large"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
                         "where": {"type": "object", "required": ["x"], "properties": {"x": {"type": "boolean"}}}}}
# tool calling (issue 37): a forced call is a constraint like the structured cases; "none" renders the tools only
TOOL_CASES = ("tools-named", "tools-required-seeded-n2", "tools-none-logprobs")
TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "required": ["kind", "count"],
    "properties": {"kind": {"enum": ["small", "large"]}, "count": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
         {"type": "function", "function": {"name": "note", "parameters": {
             "type": "object", "required": ["text"], "properties": {"text": {"type": "string", "maxLength": 5}}}}}]
KNOBS = ("logit-bias", "logit-bias-ban", "logit-bias-seeded", "frequency-penalty", "frequency-penalty-seeded",
         "presence-penalty", "presence-penalty-seeded", "penalties-logprobs")
COMMON = ("greedy", "greedy-max1", "logprobs", "logprobs-max1", "seeded", "seeded-n3", "seeded-n3-max1",
          "n3-logprobs", "stop-first-token", "stop-inside-first-token", "stop-across-tokens", "stop-last-token",
          "stop-include", "stop-id-first-min-tokens", "stop-id-across", "min-tokens-stop-string", "min-tokens-eos",
          *KNOBS, *STRUCTURED)
NAMES = {CMPL: (*COMMON, "prompt-list", "prompt-list-n2-seeded", "echo", "echo-max0", "echo-logprobs",
               "echo-logprobs-max0", "echo-n2-seeded-logprobs", "loglikelihood-batch", "prompt-logprobs",
               "prompt-logprobs-echo"),
         CHAT: (*COMMON, "no-generation-prompt", "echo-last-message", "prompt-logprobs", *TOOL_CASES)}
NO_STREAM = {"prompt-logprobs", "prompt-logprobs-echo"}    # prompt_logprobs > 0 with stream=true is a 400 (vLLM's)


def streams(name: str) -> tuple[bool, ...]:
    """The ``stream`` values case ``name`` is sent with."""
    return (False,) if name in NO_STREAM else (False, True)


@dataclass(frozen=True)
class Baseline:
    texts: dict[int, str]            # greedy text after k tokens (ignore_eos)
    token_ids: list[int]             # the first greedy token ids
    repeat_gap: float = 0.0          # raw logprob of the top token minus token_ids[0]'s, after token_ids[0]


def cases(endpoint: str, base: Baseline) -> dict[str, dict[str, Any]]:
    """name -> request body, for the names in ``NAMES[endpoint]``."""
    t = base.texts
    greedy = {**prompt_field(endpoint), "temperature": 0.0, "ignore_eos": True}
    lp = {"logprobs": 3} if endpoint == CMPL else {"logprobs": True, "top_logprobs": 3}
    seeded = {**prompt_field(endpoint), "temperature": 1.0, "top_p": 0.95, "top_k": 50}
    across = _ending_at(t[8], len(t[3]), start_before=len(t[2]))
    body = {
        "greedy": {**greedy, "max_tokens": 8},
        "greedy-max1": {**greedy, "max_tokens": 1},
        "logprobs": {**greedy, **lp, "max_tokens": 6},
        "logprobs-max1": {**greedy, **lp, "max_tokens": 1},
        "seeded": {**seeded, "seed": 1234, "max_tokens": 10},
        "seeded-n3": {**seeded, "seed": 7, "n": 3, "max_tokens": 6},
        "seeded-n3-max1": {**seeded, "seed": 7, "n": 3, "max_tokens": 1},
        "n3-logprobs": {**seeded, **lp, "seed": 3, "n": 3, "max_tokens": 4},
        "stop-first-token": {**greedy, "max_tokens": 8, "stop": [_ending_at(t[8], len(t[1]), whole=True)]},
        "stop-inside-first-token": {**greedy, "max_tokens": 8, "stop": [_ending_at(t[8], len(t[1]))]},
        "stop-across-tokens": {**greedy, "max_tokens": 8, "stop": [across]},
        "stop-last-token": {**greedy, "max_tokens": 6, "stop": [_ending_at(t[6], len(t[6]))]},
        "stop-include": {**greedy, "max_tokens": 8, "stop": [across, "\u2603"], "include_stop_str_in_output": True},
        "stop-id-first-min-tokens": {**greedy, "max_tokens": 6, "stop_token_ids": [base.token_ids[0]],
                                     "min_tokens": 2},
        "stop-id-across": {**greedy, "max_tokens": 8, "stop_token_ids": [base.token_ids[2]]},
        "min-tokens-stop-string": {**greedy, "max_tokens": 8, "min_tokens": 4,
                                   "stop": [_ending_at(t[8], len(t[1]), whole=True)]},
        "min-tokens-eos": {**prompt_field(endpoint), "temperature": 0.0, "max_tokens": 8, "min_tokens": 5},
        **_knob_cases(base, greedy, seeded, lp),
    }
    body.update(_structured(endpoint, greedy, seeded, lp))
    body["prompt-logprobs"] = {**greedy, "prompt_logprobs": 3, "max_tokens": 3}
    if endpoint == CHAT:
        body.update(_tool_cases(greedy, seeded, lp))
        body["no-generation-prompt"] = {**greedy, "messages": CONTINUE, "add_generation_prompt": False,
                                        "max_tokens": 6}
        body["echo-last-message"] = {**body["no-generation-prompt"], "echo": True}
    else:
        prompts = {"prompt": [PROMPTS[CMPL], SECOND_PROMPT]}
        body["prompt-list"] = {**greedy, **prompts, **lp, "max_tokens": 5}
        body["prompt-list-n2-seeded"] = {**seeded, **prompts, "n": 2, "seed": 11, "max_tokens": 5}
        body.update(_echo_cases(greedy, seeded, prompts))
    return body


def _echo_cases(greedy: dict, seeded: dict, prompts: dict) -> dict[str, dict[str, Any]]:
    """Completions ``echo`` (lm-eval-harness's loglikelihood: echo, max_tokens 0 or 1, logprobs 1) and
    ``prompt_logprobs``."""
    return {
        "echo": {**greedy, "echo": True, "max_tokens": 4},
        "echo-max0": {**greedy, "echo": True, "max_tokens": 0},
        "echo-logprobs": {**greedy, "echo": True, "logprobs": 2, "max_tokens": 4},
        "echo-logprobs-max0": {**greedy, "echo": True, "logprobs": 1, "max_tokens": 0},
        "echo-n2-seeded-logprobs": {**seeded, "echo": True, "logprobs": 1, "n": 2, "seed": 5, "max_tokens": 3},
        "loglikelihood-batch": {**greedy, **prompts, "echo": True, "logprobs": 1, "max_tokens": 1},
        "prompt-logprobs-echo": {**greedy, "prompt_logprobs": 2, "echo": True, "logprobs": 1, "max_tokens": 2},
    }


def _knob_cases(base: Baseline, greedy: dict, seeded: dict, lp: dict) -> dict[str, dict[str, Any]]:
    """logit_bias, frequency_penalty and presence_penalty, greedy and seeded (issue 37). The penalised cases push
    the first greedy token with a bias 1 above its repeat gap: unpenalised it is picked again as the second
    token (``logit-bias``), penalised for the one time it was generated -- on the prefill node -- it is not."""
    ids = base.token_ids
    push = {"logit_bias": {str(ids[0]): round(base.repeat_gap + 1.0, 3)}}
    return {
        "logit-bias": {**greedy, **push, "max_tokens": 8},
        "logit-bias-ban": {**greedy, "max_tokens": 6, "logit_bias": {str(ids[1]): -100, str(ids[3]): -100, "300": 3}},
        "logit-bias-seeded": {**seeded, "seed": 23, "max_tokens": 6, "logit_bias": {str(ids[0]): 4, str(ids[2]): -100}},
        "frequency-penalty": {**greedy, **push, "max_tokens": 8, "frequency_penalty": 2.0},
        "frequency-penalty-seeded": {**seeded, **push, "seed": 21, "max_tokens": 8, "frequency_penalty": 2.0},
        "presence-penalty": {**greedy, **push, "max_tokens": 8, "presence_penalty": 2.0},
        "presence-penalty-seeded": {**seeded, **push, "seed": 22, "max_tokens": 8, "presence_penalty": -2.0},
        "penalties-logprobs": {**greedy, **lp, **push, "max_tokens": 8, "frequency_penalty": 1.5,
                               "presence_penalty": 1.0},
    }


def _structured(endpoint: str, greedy: dict, seeded: dict, lp: dict) -> dict[str, dict[str, Any]]:
    """Each way of asking for structured output, on both endpoints (response_format json_schema on chat,
    vLLM's structured_outputs on completions, guided_* on both)."""
    schema = ({"response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}}
              if endpoint == CHAT else {"structured_outputs": {"json": SCHEMA}})
    return {
        "json-schema": {**greedy, **schema, "max_tokens": 160},
        "json-schema-seeded-n2": {**seeded, **schema, "seed": 5, "n": 2, "max_tokens": 160},
        "json-object-logprobs": {**greedy, **lp, "response_format": {"type": "json_object"}, "max_tokens": 12},
        "regex": {**greedy, "guided_regex": "[a-z]{1,5}( [a-z]{1,5}){0,3}", "max_tokens": 32},
        "choice-seeded": {**seeded, "seed": 9, "guided_choice": ["alpha", "beta gamma", "delta"], "max_tokens": 16},
        "grammar": {**greedy, "max_tokens": 32,
                    "structured_outputs": {"grammar": 'root ::= "(" num ("," num){0,2} ")"\nnum ::= [0-9]{1,3}'}},
        "guided-json-stop-string": {**greedy, "guided_json": SCHEMA, "stop": ['"kind"'], "max_tokens": 160},
    }


def _tool_cases(greedy: dict, seeded: dict, lp: dict) -> dict[str, dict[str, Any]]:
    return {
        "tools-named": {**greedy, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "pick"}},
                        "max_tokens": 40},
        "tools-required-seeded-n2": {**seeded, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
                                     "seed": 13, "n": 2, "max_tokens": 60},
        "tools-none-logprobs": {**greedy, **lp, "tools": TOOLS, "tool_choice": "none", "max_tokens": 6},
    }


def prompt_field(endpoint: str) -> dict[str, Any]:
    return {"prompt": PROMPTS[CMPL]} if endpoint == CMPL else {"messages": PROMPTS[CHAT]}


def _ending_at(text: str, end: int, start_before: int | None = None, whole: bool = False) -> str:
    """A substring of ``text`` whose first occurrence ends at ``end``: the whole prefix when ``whole``,
    else the shortest that starts before ``start_before`` (if given), is not blank and has no U+FFFD."""
    if whole:
        return text[:end]
    for n in range(1, end + 1):
        s, start = text[end - n:end], end - n
        if s.strip() and "\ufffd" not in s and text.find(s) == start and start < (start_before or end):
            return s
    return text[:end]


# ---- comparing two answers -----------------------------------------------------------------------

IGNORED = {"id", "created", "system_fingerprint", "prompt_tokens_details", "kv_transfer"}


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Every place where two JSON values differ (ids, timestamps and KV accounting aside)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = (set(a) | set(b)) - IGNORED
        return [d for k in sorted(keys) for d in differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items vs {len(b)}: {a!r} vs {b!r}"[:600]]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if math.isclose(a, b, abs_tol=1e-3) else [f"{path}: {a!r} vs {b!r}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"[:600]]


def by_choice(events: list[dict]) -> dict[str, list]:
    """A stream as per-choice event lists (choices interleave differently across nodes) + usage events."""
    out: dict[str, list] = {"usage": []}
    for event in events:
        rest = {k: v for k, v in event.items() if k != "choices"}
        if not event["choices"]:
            out["usage"].append(rest)
        for choice in event["choices"]:
            out.setdefault(f"choice {choice['index']}", []).append({**rest, "choice": choice})
    return out
