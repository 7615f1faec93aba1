"""Structured outputs over HTTP with the official ``openai`` client (issue 37): a local P/D cluster (store daemon,
prefill node, decode node, proxy: what ``pdserve serve`` runs) and a colocated node with its engine core in a
process of its own (which loads no tokenizer until its first structured request), on a tiny random model.

- ``response_format`` json_schema (a nested object, an enum, an array, required fields): every answer parses and
  validates, through the proxy and against the node, and greedy answers are the same on both.
- ``client.beta.chat.completions.parse`` with a pydantic model gives the parsed object.
- ``structured_outputs`` / ``guided_*`` on /v1/completions: regex, choice, EBNF grammar, json_object.
- A bad schema, regex or grammar, two constraints at once, a json_schema without its schema: 400 naming the
  field from the node and from the proxy alike (the proxy answers it from its own check); both keep
  serving (``response_format`` "text" is no constraint: it goes with a ``guided_choice``).
"""

from __future__ import annotations

import json
import re
from enum import Enum
from typing import Annotated

import httpx
import pytest
from pydantic import BaseModel, Field

from conftest import openai_client, pd_and_colocated
from test_structured_engine import CHOICES, EBNF, REGEX, SCHEMA, check_schema

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


class Color(str, Enum):
    red = "red"
    green = "green"


class Address(BaseModel):
    city: str = Field(max_length=6)
    zip: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    color: Color
    tags: list[Annotated[str, Field(max_length=4)]] = Field(max_length=3)
    address: Address


@pytest.fixture(scope="module")
def servers(tiny_llama):
    """{"proxy": url, "node": url}: a P/D cluster and a colocated node (engine core in its own process)."""
    with pd_and_colocated(tiny_llama, node_flags=("--engine-core-process",)) as urls:
        yield urls


def _client(url: str):
    return openai_client(url, 120)


def test_json_schema_answers_validate_and_match(servers):
    answers = {}
    for where, url in servers.items():
        client = _client(url)
        r = client.chat.completions.create(
            model="llama", messages=MESSAGES, max_tokens=200, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                    "strict": True}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (where, choice)
        check_schema(choice.message.content)
        seeded = client.chat.completions.create(
            model="llama", messages=MESSAGES, max_tokens=200, temperature=1.0, seed=3, n=2,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
        for c in seeded.choices:
            assert c.finish_reason == "stop", (where, c)
            check_schema(c.message.content)
        answers[where] = [choice.message.content] + [c.message.content for c in seeded.choices]
    assert answers["proxy"] == answers["node"]


def test_parse_with_a_pydantic_model(servers):
    for where, url in servers.items():
        r = _client(url).beta.chat.completions.parse(model="llama", messages=MESSAGES, max_tokens=200,
                                                     temperature=0, response_format=Person)
        person = r.choices[0].message.parsed
        assert isinstance(person, Person) and isinstance(person.address, Address), (where, r)
        assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, check", [
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"structured_outputs": {"choice": list(CHOICES)}}, lambda t: t in CHOICES),
    ({"guided_grammar": EBNF}, lambda t: re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?){0,3}\)", t)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, lambda t: check_schema(t) or True),
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
], ids=["guided_regex", "choice", "guided_grammar", "structured_outputs.json", "json_object"])
def test_completions_with_each_kind(servers, body, check):
    texts = {}
    for where, url in servers.items():
        stream = _client(url).completions.create(model="llama", prompt="JSON:", max_tokens=200, temperature=0,
                                                 stream=True, extra_body=body)
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop", (where, text)
        assert check(text), (where, text)
        texts[where] = text
    assert texts["proxy"] == texts["node"]


BAD = [
    ({"guided_json": {"type": "object", "properties": 5}}, "guided_json", "invalid JSON schema"),
    ({"guided_json": '{"type": '}, "guided_json", "not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "needs json_schema.schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "invalid regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "invalid EBNF grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one structured-output"),
    ({"guided_json": "[" * 40 + "]" * 40}, "guided_json", "nests 40 levels"),
]


@pytest.mark.parametrize("extra, param, words", BAD, ids=[b[1] + "-" + b[2].split()[-1] for b in BAD])
def test_bad_constraints_are_400_naming_the_field(servers, extra, param, words):
    for where, url in servers.items():
        for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})):
            r = httpx.post(url + path, json={**body, **extra, "max_tokens": 5}, timeout=60)
            assert r.status_code == 400, (where, path, r.text)
            error = r.json()["error"]
            assert error["param"] == param and words in error["message"], (where, error)
        ok = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "guided_choice": ["ab"],
                                                       "response_format": {"type": "text"}}, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ab", (where, ok.text)

