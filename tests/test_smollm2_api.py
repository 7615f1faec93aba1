"""Structured outputs and tool calling on the demo model, SmolLM2-135M-Instruct, as ``pdserve serve`` runs it (a P/D
cluster behind the proxy) and on a colocated node, with the official ``openai`` client (issue 37's check on a real
model; ``test_structured_http.py`` and ``test_tool_calls.py`` do the same on tiny random models).

- ``response_format`` json_schema with a nested object, an enum, an array and required fields: the answer parses,
  validates, and is the same greedy answer colocated and disaggregated; ``beta.chat.completions.parse`` with a
  pydantic model gives the object.
- ``tool_choice="required"`` and a named tool: calls whose arguments validate, equal across P/D; streamed, they
  reassemble to the same calls.
"""

from __future__ import annotations

import json
from enum import Enum

import jsonschema_rs
import pytest
from pydantic import BaseModel, Field

from conftest import openai_client, pd_and_colocated
from test_tool_calls import _calls, _stream

openai = pytest.importorskip("openai")

CITY = {"type": "object", "required": ["name", "country", "population", "tags", "location"],
        "properties": {"name": {"type": "string", "maxLength": 20}, "country": {"enum": ["France", "Italy", "Spain"]},
                       "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
                       "location": {"type": "object", "required": ["lat", "lon"],
                                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}}}}
WEATHER = {"type": "object", "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Describe Paris as JSON."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Country(str, Enum):
    france = "France"
    italy = "Italy"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: Country
    tags: list[str] = Field(max_length=2)


@pytest.fixture(scope="module")
def servers(smollm2):
    with pd_and_colocated(smollm2) as urls:
        yield urls


def _client(url: str):
    return openai_client(url, 300)


def test_json_schema_and_parse(servers):
    answers = {}
    for where, url in servers.items():
        client = _client(url)
        r = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=ASK, max_tokens=160, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
        assert r.choices[0].finish_reason == "stop", (where, r)
        jsonschema_rs.validate(CITY, json.loads(r.choices[0].message.content))
        parsed = client.beta.chat.completions.parse(model="smollm2-135m-instruct", messages=ASK, max_tokens=120,
                                                    temperature=0, response_format=City)
        assert isinstance(parsed.choices[0].message.parsed, City), (where, parsed)
        answers[where] = (r.choices[0].message.content, parsed.choices[0].message.content)
    assert answers["proxy"] == answers["node"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_calls(servers, choice):
    answers = {}
    for where, url in servers.items():
        client = _client(url)
        kwargs = dict(model="smollm2-135m-instruct", messages=WEATHER_ASK, tools=TOOLS, tool_choice=choice,
                      parallel_tool_calls=False, max_tokens=80, temperature=0)
        r = client.chat.completions.create(**kwargs)
        calls = _calls(r.choices[0].message)
        assert r.choices[0].finish_reason == "tool_calls" and [n for n, _ in calls] == ["get_weather"], (where, r)
        jsonschema_rs.validate(WEATHER, json.loads(calls[0][1]))
        assert _stream(client, **kwargs) == (calls, "tool_calls", ""), where
        answers[where] = calls
    assert answers["proxy"] == answers["node"]
