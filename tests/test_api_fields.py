"""Every request field a client can send is implemented, refused, or documented as taken without effect (issue 37).

The walk: every field of the ``openai`` client's request types (chat and completions, ``stream`` from their
streaming variants) and of ``VLLM_EXTRAS`` has an entry in ``CHAT`` / ``COMPLETIONS``: a value to send and what
must happen, against a baseline sent in the same test (greedy, a few tokens, a tiny llama):

    refused     a 400 (the model: a 404) whose ``param`` or message names the field
    changes     the answer (its text, or its shape: status, keys, choices, usage) differs from the baseline's
    no_effect   the field is in ``fields.NO_EFFECT`` (docs/api-fields.md) and the answer equals the baseline's

``COVERED_ELSEWHERE`` names the test of each field another test owns. A field the ``openai`` package grows, or one
``protocol.py`` declares, that no entry classifies fails ``test_every_field_is_classified``: the walk is exhaustive.
Values that ask for what pdserve does anyway (``skip_special_tokens`` true, ``best_of`` = n ...) are accepted and
change nothing. A sample of refusals goes through the proxy too (in process, in front of a scripted node that
records its calls): the same 400 as the node's, and no node called.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from fake_node import FakeNode, ServerThread
from pdserve.engine.server import fields
from pdserve.engine.server.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from pdserve.engine.text.tokenizer import load_tokenizer
from pdserve.proxy.app import build_app
from pdserve.proxy.config import ProxyConfig
from polling import wait_until

CMPL, CHAT_PATH, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
PROMPT = "Once upon a time"
USER = [{"role": "user", "content": PROMPT}]
N, EOS = 80, 2                         # the tiny llama's token 80 is "n"; 2 is its EOS
FORCE_N = {"logit_bias": {str(N): 100}}
FORCE_EOS = {"logit_bias": {str(EOS): 100}}
SAMPLED = {"temperature": 5.0, "seed": 1}          # near-uniform over 512 tokens: any filter changes the text
# 24 tokens out of 32 (ids 64-95, all biased alike): the text repeats tokens, which the penalties then push down
REPEATS = {"max_tokens": 24, "logit_bias": {str(t): 100 for t in range(64, 96)}}
BASE = {CMPL: {"prompt": PROMPT, "max_tokens": 6, "temperature": 0},
        CHAT_PATH: {"messages": USER, "max_tokens": 6, "temperature": 0}}


@dataclass(frozen=True)
class Case:
    kind: str                            # "refused", "changes" or "no_effect"
    value: Any = None                    # the value sent
    base: dict = field(default_factory=dict)    # sent with the baseline and with the value alike


def refused(value: Any, **base: Any) -> Case:
    return Case("refused", value, base)


def changes(value: Any, base: dict | None = None) -> Case:
    return Case("changes", value, base or {})


def no_effect(value: Any) -> Case:
    return Case("no_effect", value)


COVERED_ELSEWHERE = {
    "tools": "tests/test_tool_calls.py",
    "tool_choice": "tests/test_tool_calls.py",
    "parallel_tool_calls": "tests/test_tool_calls.py",
    "prompt_token_ids": "tests/test_pd_parity.py",        # pdserve's P/D fields: the proxy sets them
    "kv_transfer_params": "tests/test_pd_parity.py",
}

_SHARED = {                              # OpenAI's fields both endpoints take
    "model": changes("no-such-model"),   # a 404 naming the model
    "n": changes(2),
    "stream": changes(True),
    "stream_options": changes({"include_usage": True}, {"stream": True}),
    "temperature": changes(5.0, {"seed": 1}),
    "top_p": changes(0.05, SAMPLED),
    "stop": changes("n", FORCE_N),
    "seed": changes(2, SAMPLED),
    "presence_penalty": changes(2.0, REPEATS),
    "frequency_penalty": changes(2.0, REPEATS),
    "logit_bias": changes({str(N): 100}),
    "max_tokens": changes(2),
    "response_format": changes({"type": "json_object"}),
    "user": no_effect("user-1"),
    "metadata": no_effect({"team": "search"}),
    "store": no_effect(True),
    "safety_identifier": no_effect("hashed-user"),
    "prompt_cache_key": no_effect("key-1"),
    "service_tier": no_effect("flex"),
}
_VLLM_SUPPORTED = {
    "top_k": changes(1, SAMPLED),
    "min_p": changes(0.5, SAMPLED),
    "repetition_penalty": changes(5.0, REPEATS),
    "ignore_eos": changes(True, FORCE_EOS),
    "min_tokens": changes(3, FORCE_EOS),
    "stop_token_ids": changes([N], FORCE_N),
    "include_stop_str_in_output": changes(True, {**FORCE_N, "stop": "n"}),
    "prompt_logprobs": changes(1),
    "structured_outputs": changes({"choice": ["yes", "no"]}),
    "guided_json": changes({"type": "object"}),
    "guided_regex": changes("a+"),
    "guided_choice": changes(["yes", "no"]),
    "guided_grammar": changes('root ::= "yes" | "no"'),
    "best_of": refused(3),
}
_VLLM_REFUSED = {
    "use_beam_search": refused(True),
    "length_penalty": refused(2.0),
    "truncate_prompt_tokens": refused(4),
    "allowed_token_ids": refused([1, 2]),
    "bad_words": refused(["x"]),
    "priority": refused(1),
    "skip_special_tokens": refused(False),
    "spaces_between_special_tokens": refused(False),
    "logits_processors": refused(["my.module:Processor"]),
    "return_tokens_as_token_ids": refused(True),
    "return_token_ids": refused(True),
    "vllm_xargs": refused({"a": 1}),
    "request_id": refused("req-1"),
    "guided_decoding_backend": refused("outlines"),
    "guided_whitespace_pattern": refused(" "),
}
COMPLETIONS: dict[str, Case] = {
    **_SHARED, **_VLLM_SUPPORTED, **_VLLM_REFUSED,
    "prompt": changes("Hello there"),
    "cache_salt": changes("walk-salt", {"prompt": PROMPT * 4}),   # the baseline's prompt is cached, not a new salt's
    "logprobs": changes(2),
    "echo": changes(True),
    "suffix": refused(" the end"),
    "add_special_tokens": refused(False),
    "prompt_embeds": refused("AAAA"),
}
CHAT: dict[str, Case] = {
    **_SHARED, **_VLLM_SUPPORTED, **_VLLM_REFUSED,
    "messages": changes([{"role": "user", "content": "Hello there"}]),
    "cache_salt": changes("walk-salt"),          # the templated prompt fills a block: cached, not a new salt's
    "logprobs": changes(True),
    "top_logprobs": changes(2, {"logprobs": True}),
    "max_completion_tokens": changes(2),
    "echo": changes(True, {"messages": [*USER, {"role": "assistant", "content": "Twice"}],
                           "add_generation_prompt": False}),
    "add_generation_prompt": changes(False),
    "audio": refused({"voice": "alloy", "format": "wav"}),
    "modalities": refused(["text", "audio"]),
    "prediction": refused({"type": "content", "content": "Once"}),
    "reasoning_effort": refused("low"),
    "verbosity": refused("low"),
    "web_search_options": refused({}),
    "moderation": refused({"model": "omni-moderation-latest"}),
    "functions": refused([{"name": "f", "parameters": {}}]),
    "function_call": refused("auto"),
    "prompt_cache_retention": refused("24h"),
    "prompt_cache_options": refused({"ttl": "1h"}),
    "add_special_tokens": refused(True),
    "continue_final_message": refused(True),
    "chat_template": refused("{{ messages[0].content }}"),
    "chat_template_kwargs": refused({"enable_thinking": False}),
    "documents": refused([{"title": "t", "text": "x"}]),
    "mm_processor_kwargs": refused({"num_crops": 4}),
}
TABLES = {CMPL: COMPLETIONS, CHAT_PATH: CHAT}
VLLM_EXTRAS = sorted({*_VLLM_SUPPORTED, *_VLLM_REFUSED, "echo", "add_generation_prompt", "add_special_tokens",
                      "continue_final_message", "chat_template", "chat_template_kwargs", "documents",
                      "mm_processor_kwargs", "prompt_embeds", "kv_transfer_params", "prompt_token_ids"})
OPENAI_FIELDS = {
    CHAT_PATH: {*chat_params.CompletionCreateParamsBase.__annotations__,
                *chat_params.CompletionCreateParamsStreaming.__annotations__},
    CMPL: {*completion_params.CompletionCreateParamsBase.__annotations__,
           *completion_params.CompletionCreateParamsStreaming.__annotations__},
}
VLLM_ENDPOINT_ONLY = {CMPL: {"prompt_embeds"}, CHAT_PATH: {"add_generation_prompt", "continue_final_message",
                                                          "chat_template", "chat_template_kwargs", "documents",
                                                          "mm_processor_kwargs"}}


# -- the tables themselves (no server) ----------------------------------------------------------------------

@pytest.mark.parametrize("path, model", [(CMPL, CompletionRequest), (CHAT_PATH, ChatCompletionRequest)])
def test_every_field_is_classified(path, model):
    """The openai package's fields, vLLM's extras and every field ``protocol.py`` declares each have an entry."""
    table = TABLES[path]
    assert not set(table) & set(COVERED_ELSEWHERE)
    vllm = {f for f in VLLM_EXTRAS if f not in VLLM_ENDPOINT_ONLY[CMPL if path == CHAT_PATH else CHAT_PATH]}
    declared = {f.alias or name for name, f in model.model_fields.items()}
    for source, names in (("openai", OPENAI_FIELDS[path]), ("vLLM", vllm), ("protocol.py", declared)):
        missing = sorted(names - set(table) - set(COVERED_ELSEWHERE))
        assert not missing, f"{source} fields of {path} the walk does not classify: {missing}"
    assert {"stream", "stream_options"} <= set(table)


@pytest.mark.parametrize("path", [CMPL, CHAT_PATH])
def test_the_tables_agree_with_fields_py(path):
    """no_effect entries are exactly ``NO_EFFECT``; every refusal ``fields.py`` declares is walked as refused."""
    table = TABLES[path]
    assert {name for name, case in table.items() if case.kind == "no_effect"} == set(fields.NO_EFFECT)
    declared = fields.CHAT_REFUSED if path == CHAT_PATH else fields.COMPLETION_REFUSED
    assert {name for name in declared if table.get(name, no_effect(None)).kind != "refused"} == set()


def test_the_doc_lists_every_field_fields_py_names():
    """docs/api-fields.md names every field taken without effect and every refused one (with its reason)."""
    doc = (Path(__file__).resolve().parent.parent / fields.DOC).read_text()
    tables = [fields.CHAT_REFUSED, fields.COMPLETION_REFUSED,
              {f"stream_options.{k}": v for k, v in fields.STREAM_OPTIONS_REFUSED.items()}]
    names = [*fields.NO_EFFECT, *(name for table in tables for name in table), "best_of"]
    missing = [name for name in names if f"`{name}`" not in doc]
    assert not missing, missing
    assert not [(name, r.reason) for t in tables for name, r in t.items() if r.reason.split(";")[0] not in doc]
    assert not [(name, reason) for name, reason in fields.NO_EFFECT.items() if reason not in doc.replace("`", "")]


# -- the walk, against a node ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def node(node_factory, tiny_llama):
    return node_factory(tiny_llama, "--max-model-len", "128", "--num-gpu-blocks-override", "64")


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60)


def _view(response: httpx.Response) -> tuple[int, Any]:
    """What a client sees, less what differs between any two answers (``id``, ``created``)."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        return response.status_code, [_drop_ids(json.loads(e)) if e != "[DONE]" else e for e in events]
    return response.status_code, _drop_ids(response.json())


def _drop_ids(body: Any) -> Any:
    return {k: v for k, v in body.items() if k not in ("id", "created")} if isinstance(body, dict) else body


class Baselines:
    """Baseline answers by body, each sent twice and the second kept (its prompt is then in the prefix cache,
    as it is for every request sent after it)."""

    def __init__(self, url: str):
        self.url, self._seen = url, {}

    def view(self, path: str, body: dict) -> tuple[int, Any]:
        key = json.dumps([path, body], sort_keys=True)
        if key not in self._seen:
            _post(self.url, path, body)
            self._seen[key] = _view(_post(self.url, path, body))
            assert self._seen[key][0] == 200, self._seen[key]
        return self._seen[key]


def _names(error: dict, name: str) -> bool:
    param = error.get("param") or ""
    return param == name or param.startswith(name + ".") or f"'{name}'" in error["message"] \
        or f"{name}=" in error["message"]


def _walk_one(baselines: Baselines, path: str, name: str, case: Case) -> str | None:
    """What is wrong with ``name``'s answer, or None."""
    base = {**BASE[path], **case.base}
    response = _post(baselines.url, path, {**base, name: case.value})
    if case.kind == "refused":
        status = 404 if name == "model" else 400
        if response.status_code != status or not _names(response.json()["error"], name):
            return f"not refused by name: {response.status_code} {response.text[:300]}"
        return None
    same = _view(response) == baselines.view(path, base)
    if case.kind == "changes" and same:
        return f"the answer is the baseline's: {response.text[:300]}"
    if case.kind == "no_effect" and not same:
        return f"the answer differs from the baseline's: {response.text[:300]}"
    return None


@pytest.mark.parametrize("path", [CMPL, CHAT_PATH])
def test_the_walk(node, path):
    """Every entry of the endpoint's table, against the node: one failure list for all of them."""
    baselines = Baselines(node.url)
    failures = {name: problem for name, case in TABLES[path].items()
                if (problem := _walk_one(baselines, path, name, case)) is not None}
    assert not failures, "\n".join(f"{name}: {problem}" for name, problem in failures.items())


def _same_values(path: str) -> list[tuple[str, Any]]:
    table = fields.CHAT_REFUSED if path == CHAT_PATH else fields.COMPLETION_REFUSED
    sent = [(name, value) for name, refusal in table.items() for value in (None, *refusal.same)]
    return sent + [("best_of", None), ("best_of", 1), ("stream_options", {"include_obfuscation": False,
                                                                         "continuous_usage_stats": False})]


@pytest.mark.parametrize("path", [CMPL, CHAT_PATH])
def test_values_that_ask_for_what_pdserve_does_anyway_change_nothing(node, path):
    """null for every refused field, and the values ``Refused.same`` lists: accepted, the baseline's answer."""
    baselines = Baselines(node.url)
    expected = baselines.view(path, BASE[path])
    failures = [(name, value, r.text[:200]) for name, value in _same_values(path)
                if _view(r := _post(node.url, path, {**BASE[path], name: value})) != expected]
    assert not failures, failures


def test_best_of_equal_to_n_is_accepted_and_other_values_are_refused_naming_both(node):
    body = {**BASE[CMPL], "n": 2}
    assert _post(node.url, CMPL, {**body, "best_of": 2}).json()["choices"] == \
        _post(node.url, CMPL, body).json()["choices"]
    error = _post(node.url, CMPL, {**body, "best_of": 1}).json()["error"]
    assert error["param"] == "best_of" and "best_of=1 with n=2" in error["message"], error


NESTED = [             # (path, body, the error's param): unknown keys of nested request objects
    (CMPL, {**BASE[CMPL], "stream": True, "stream_options": {"include_usage": True, "per_chunk": True}},
     "stream_options.per_chunk"),
    (CMPL, {**BASE[CMPL], "stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    (CHAT_PATH, {**BASE[CHAT_PATH], "response_format": {"type": "json_object", "schema": {}}},
     "response_format.schema"),
    (CHAT_PATH, {**BASE[CHAT_PATH], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "additional": 1}}}, "response_format.json_schema.additional"),
    (CMPL, {**BASE[CMPL], "structured_outputs": {"choice": ["a"], "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    (CHAT_PATH, {**BASE[CHAT_PATH], "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]},
     "messages.0.content.0.cache_control"),
    (TOK, {"prompt": PROMPT, "return_tokens": True}, "return_tokens"),
    (TOK, {"messages": USER, "add_special_tokens": True}, "add_special_tokens"),
    (TOK, {"prompt": PROMPT, "add_generation_prompt": False}, "add_generation_prompt"),
    (DETOK, {"tokens": [5, 6], "skip_special_tokens": False}, "skip_special_tokens"),
]


@pytest.mark.parametrize("path, body, param", NESTED, ids=[p for _, _, p in NESTED])
def test_nested_objects_and_the_other_routes_refuse_unknown_keys(node, path, body, param):
    response = _post(node.url, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error


def test_a_messages_own_keys_still_reach_the_template_and_tokenize_shows_token_strs(node):
    named = {**BASE[CHAT_PATH], "messages": [{**USER[0], "name": "ann", "reasoning_content": "hm"}]}
    assert _post(node.url, CHAT_PATH, named).status_code == 200
    answer = _post(node.url, TOK, {"prompt": "Once", "return_token_strs": True}).json()
    assert answer["token_strs"] == ["O", "n", "c", "e"] and len(answer["tokens"]) == 4


# -- the proxy: the same refusals, no node called ---------------------------------------------------------------

PROXY_SAMPLE = [(CMPL, "suffix"), (CMPL, "best_of"), (CMPL, "skip_special_tokens"), (CMPL, "use_beam_search"),
                (CHAT_PATH, "audio"), (CHAT_PATH, "functions"), (CHAT_PATH, "reasoning_effort"),
                (CHAT_PATH, "chat_template_kwargs"), (CHAT_PATH, "add_special_tokens")]
PROXY_OTHER = [(CMPL, {**BASE[CMPL], "foo": 1}), (CHAT_PATH, {**BASE[CHAT_PATH], "suffix": "x"}), *NESTED[:6]]


@pytest.fixture(scope="module")
def fake():
    node = FakeNode(max_model_len=128)
    yield node
    node.stop()


@pytest.fixture(scope="module")
def proxy(tiny_llama, fake):
    server = ServerThread(build_app(ProxyConfig(prefill_urls=(fake.url,), decode_urls=(fake.url,),
                                                model=str(tiny_llama)), load_tokenizer(tiny_llama)))
    wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, 30, "proxy ready")
    yield server.url
    server.stop()


def test_the_proxy_refuses_as_the_node_does_without_calling_a_node(node, proxy, fake):
    bodies = [(path, {**BASE[path], name: TABLES[path][name].value}) for path, name in PROXY_SAMPLE]
    bodies += [(path, body) for path, body, *_ in PROXY_OTHER]
    calls = len(fake.calls)
    for path, body in bodies:
        from_proxy, from_node = _post(proxy, path, body), _post(node.url, path, body)
        assert from_proxy.status_code == 400, from_proxy.text
        assert from_proxy.json() == from_node.json()
    assert len(fake.calls) == calls, "the proxy called a node for a request it must refuse"


def test_the_proxy_forwards_no_effect_fields_and_accepted_values(proxy, fake):
    body = {**BASE[CHAT_PATH], **{name: case.value for name, case in CHAT.items() if case.kind == "no_effect"},
            "skip_special_tokens": True, "best_of": 1}
    assert _post(proxy, CHAT_PATH, body).status_code == 200
    sent = fake.posts(CHAT_PATH)[-1]
    assert {name: sent.get(name) for name in body if name != "model"} == \
        {name: value for name, value in body.items() if name != "model"}


def test_stream_options_refusals_are_declared():
    """The nested table is the model's: each of its fields exists on ``StreamOptions``."""
    assert set(fields.STREAM_OPTIONS_REFUSED) <= set(StreamOptions.model_fields)
