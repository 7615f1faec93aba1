"""The node's OpenAI-compatible server, end to end: a real `pdserve node` subprocess + the `openai` client.

Two nodes per module: `node` (tiny llama, --max-model-len 256) for the API surface and bad input;
`keyed` (a long-context tiny llama, --api-key) for auth and for the mid-stream disconnect, where a
request asks for 100k tokens so that only an abort can end it while the test waits.
"""

from __future__ import annotations

import json
import random
import socket

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.checkpoints.tiny_model import make_tiny_model
from polling import wait_until

MAX_MODEL_LEN = 256
API_KEY = "test-secret"
PROMPT = "The quick brown fox jumps over the lazy dog"
ABORTED = {"name": "vllm:request_success_total", "finished_reason": "abort"}


@pytest.fixture(scope="module")
def node(node_factory, tiny_llama):
    return node_factory(tiny_llama, "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "128")


@pytest.fixture(scope="module")
def keyed(node_factory, tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("long") / "long-llama", arch="llama",
                            max_position_embeddings=131072)
    return node_factory(model, "--api-key", API_KEY, "--num-gpu-blocks-override", "8200")


@pytest.fixture(scope="module")
def client(node) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _tokenize(node, text: str) -> list[int]:
    return httpx.post(node.url + "/tokenize", json={"prompt": text}).json()["tokens"]


def _metric(url: str, name: str, required: bool = True, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``, from /metrics."""
    response = httpx.get(url + "/metrics")
    assert response.status_code == 200, response.text
    values = []
    for family in text_string_to_metric_families(response.text):
        values += [s.value for s in family.samples
                   if s.name == name and labels.items() <= s.labels.items()]
    assert values or not required, f"{name} {labels} not in /metrics"
    return sum(values)


def _wait_for(condition, what: str, timeout: float = 30.0) -> None:
    wait_until(condition, timeout, what)


# -- the API surface --------------------------------------------------------------------------------

def test_models_health_and_tokenize_round_trip(node, client, model):
    assert model == "llama" and client.models.list().data[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(node.url + "/health").status_code == 200
    ids = _tokenize(node, PROMPT)
    assert httpx.post(node.url + "/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}


def test_completion_stream_equals_non_stream_with_usage(node, client, model):
    prompt_ids = _tokenize(node, PROMPT)
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.id.startswith("cmpl-") and full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(prompt_ids), 12)
    assert full.usage.total_tokens == len(prompt_ids) + 12
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            logprobs=0, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in body) == full.choices[0].text
    assert all(len(c.choices[0].logprobs.tokens) == 1 for c in body)     # one token per chunk
    assert body[-1].choices[0].finish_reason == "length"


def test_token_id_prompt_equals_text_prompt(node, client, model):
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=model, prompt=_tokenize(node, PROMPT), max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_chat_stream_equals_non_stream_with_usage(node, client, model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    rendered = httpx.post(node.url + "/tokenize", json={"messages": messages}).json()["count"]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.id.startswith("chatcmpl-") and full.choices[0].message.role == "assistant"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (rendered, 10)
    stream = list(client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert stream[-1].choices == [] and stream[-1].usage.total_tokens == rendered + 10
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"


def test_chat_default_max_tokens_fills_the_context(client, model):
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "go"}],
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.total_tokens == MAX_MODEL_LEN and out.choices[0].finish_reason == "length"


def test_n_choices_are_independent_and_seeded(client, model):
    def run():
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0,
                                         seed=1234, extra_body={"ignore_eos": True})
    first, again = run(), run()
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]   # seeded: reproducible
    assert first.choices[0].text != first.choices[1].text                        # choices: independent
    assert first.usage.completion_tokens == 16


def test_completion_logprobs_are_greedy_consistent(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))   # greedy picks the most likely token


def test_chat_logprobs_and_top_logprobs(client, model):
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_repeated_prompt_reports_cached_tokens(node, client, model):
    prompt = list(range(3, 3 + 40))          # 40 tokens: two full 16-token blocks are cacheable
    client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
    assert _metric(node.url, "vllm:prefix_cache_hits_total") >= 32


def test_metrics_count_requests_tokens_and_latencies(node, client, model):
    """Every figure is a before/after difference of this test's own request (any order, shared node)."""
    names = [("vllm:generation_tokens_total", {}), ("vllm:time_to_first_token_seconds_count", {}),
             ("vllm:inter_token_latency_seconds_count", {}), ("vllm:prompt_tokens_total", {}),
             ("vllm:request_success_total", {"finished_reason": "length"}),
             ("vllm:prefix_cache_queries_total", {})]
    before = [_metric(node.url, n, required=False, **labels) for n, labels in names]
    client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    prompt_len = len(_tokenize(node, PROMPT))

    def deltas() -> list[float]:
        return [_metric(node.url, n, required=False, **labels) - b for (n, labels), b in zip(names, before)]

    _wait_for(lambda: deltas() == [5, 1, 4, prompt_len, 1, prompt_len], f"metric deltas {deltas()}", 10)
    hits = _metric(node.url, "vllm:prefix_cache_hits_total")
    assert _metric(node.url, "vllm:prefix_cache_queries_total") >= hits
    assert 0.0 <= _metric(node.url, "vllm:kv_cache_usage_perc") <= 1.0


# -- bad input: 4xx with a clear message, and the node keeps serving ------------------------------

BAD_COMPLETIONS = [
    ({"model": "nope", "prompt": "hi"}, 404, "model 'nope' does not exist"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be >= 1, got 0"),
    ({"prompt": "hi", "max_tokens": -5}, 400, "max_tokens must be >= 1, got -5"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": [5] * 300}, 400, f"prompt has 300 tokens; --max-model-len is {MAX_MODEL_LEN}"),
    ({"prompt": [5] * 200, "max_tokens": 100}, 400, f"300 > --max-model-len {MAX_MODEL_LEN}"),
    ({"prompt": [], "max_tokens": 4}, 400, "prompt is empty"),
    ({"prompt": [1, 99999]}, 400, "token id 99999 is out of range"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature must be >= 0, got -1"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p must be in (0, 1], got 0"),
    ({"prompt": "hi", "n": 0}, 400, "n:"),
    ({"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs must be in [0, 20], got 21"),
    ({"prompt": "hi", "echo": True, "logprobs": 21}, 400, "logprobs must be in [0, 20], got 21"),
    ({"prompt": "hi", "stream": True, "prompt_logprobs": 2}, 400, "prompt_logprobs are not available when stream"),
    ({"max_tokens": 3}, 400, "prompt: Field required"),
]


@pytest.mark.parametrize("body,status,message", BAD_COMPLETIONS)
def test_bad_completion_requests(node, body, status, message):
    response = httpx.post(node.url + "/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_bad_json_and_bad_chat_bodies(node):
    raw = httpx.post(node.url + "/v1/chat/completions", content=b'{"messages": [', headers={
        "content-type": "application/json"})
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    empty = httpx.post(node.url + "/v1/chat/completions", json={"messages": []})
    assert empty.status_code == 400 and "messages" in empty.json()["error"]["message"]
    image = httpx.post(node.url + "/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert image.status_code == 400 and "'image_url'" in image.json()["error"]["message"]
    unknown = httpx.get(node.url + "/v1/nothing")
    assert unknown.status_code == 404 and "error" in unknown.json()


def test_openai_client_sees_clear_errors_and_node_keeps_serving(client, model):
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match=f"--max-model-len {MAX_MODEL_LEN}"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_MODEL_LEN)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3


# -- auth and disconnects (the long-context node) -------------------------------------------------

def test_api_key_is_required_except_for_health_and_metrics(keyed):
    wrong = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid or missing API key"):
        wrong.models.list()
    no_header = httpx.post(keyed.url + "/v1/completions", content=b"{not json")
    assert no_header.status_code == 401 and no_header.json()["error"]["code"] == "invalid_api_key"
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.completions.create(model="long-llama", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 200


def test_client_disconnect_mid_stream_aborts_the_request(keyed):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    aborted_before = _metric(keyed.url, **ABORTED, required=False)
    body = {"prompt": PROMPT, "max_tokens": 100_000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", keyed.url + "/v1/completions", json=body, headers=auth) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[len("data: "):])["choices"][0]["index"] == 0
            assert _metric(keyed.url, "vllm:num_requests_running") == 1
    # 100k tokens would take minutes: only the abort brings the engine back to idle.
    _wait_for(lambda: _metric(keyed.url, "vllm:num_requests_running") == 0, "running == 0 after disconnect")
    assert _metric(keyed.url, "vllm:num_requests_waiting") == 0
    assert _metric(keyed.url, **ABORTED) == aborted_before + 1


def test_client_gone_before_a_non_streaming_answer_aborts_the_request(keyed):
    """The client hangs up once its request is running (not after a read timeout that may fire before the
    engine has it). Mutation caught: ``Generation.collect`` (engine/server/generation.py) awaiting the work
    without racing the disconnect -> the request runs on and is never counted aborted."""
    aborted_before = _metric(keyed.url, **ABORTED, required=False)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 100_000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        _wait_for(lambda: _metric(keyed.url, "vllm:num_requests_running") == 1, "the request is running")
    _wait_for(lambda: _metric(keyed.url, "vllm:num_requests_running") == 0, "running == 0 after disconnect")
    assert _metric(keyed.url, "vllm:num_requests_waiting") == 0
    assert _metric(keyed.url, **ABORTED) == aborted_before + 1


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_stream_has_a_chunk_for_every_token_even_without_text(node, model, route):
    """vLLM's rule: a step that sampled a token yields a chunk, its text "" while the detokenizer holds back an
    incomplete UTF-8 sequence (byte-fallback tokens; the tiny model's random output has many). Streaming
    benchmarks count one inter-token latency per chunk: dropping empty chunks would merge two steps into one."""
    rng = random.Random(7)
    for _ in range(4):
        ids = [rng.randrange(10, 500) for _ in range(24)]
        if route == "completions":
            body = {"model": model, "prompt": ids, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
        else:
            body = {"model": model, "messages": [{"role": "user", "content": "".join(map(chr, ids))}],
                    "max_tokens": 32, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{node.url}/v1/{'completions' if route == 'completions' else 'chat/completions'}",
                          json=body, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        token_chunks = [e for e in events if e["choices"] and (route == "completions" or "role" not in
                                                               e["choices"][0]["delta"])]
        assert events[-1]["usage"]["completion_tokens"] == 32
        assert len(token_chunks) == 32, [e["choices"][0] for e in token_chunks]
