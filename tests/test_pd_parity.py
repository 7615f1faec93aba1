"""Disaggregated equals colocated, field by field, over one request matrix (issue 10).

Per tokenizer kind (byte-level BPE; SentencePiece/Metaspace, Llama-2 style) one cluster -- KV store
daemon, prefill node, decode node, proxy -- and one colocated ``--role both`` node serve the same
tiny model. Every case of ``parity_matrix.cases`` (completions and chat, streaming and not, n 1 and 3,
max_tokens 1 and more, logprobs, greedy and seeded sampling, stop strings in / across / at the last
token, stop ids, min_tokens, add_generation_prompt, prompt lists, include_stop_str_in_output, echo with and
without logprobs, max_tokens 0, prompt_logprobs: the prefill node's, carried in kv_transfer_params, and
frequency / presence penalties and logit_bias, greedy and seeded, where the first token counts, and
structured outputs of every kind: json_schema, json_object, regex, choice, grammar) is
sent to both, all cases concurrently, once per module; each test compares one case's two answers.
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from conftest import NodeProcess
from parity_matrix import (CHAT, CMPL, KNOBS, NAMES, PROMPTS, SCHEMA, TEXT_LENGTHS, Baseline, by_choice, cases,
                           differences, prompt_field, streams)
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.checkpoints.tiny_model import make_tiny_model
from pdserve.engine.text.tokenizer import apply_chat_template
from pdserve.proxy.cluster import ClusterSpec, LocalCluster

KINDS = ("bpe", "metaspace")
# Small blocks and chunks, no prefix cache: the 11-15 token prompts are loaded from the store on the decode
# node (whole blocks), not recomputed -- the suite compares loaded KV with colocated, not just the first token.
NODE_FLAGS = ("--kv-chunk-tokens", "4", "--block-size", "4", "--no-enable-prefix-caching")
CONCURRENCY = 8
CASES = [(endpoint, name, stream)
         for endpoint in (CMPL, CHAT) for name in NAMES[endpoint] for stream in streams(name)]


@dataclass
class Served:
    kind: str
    base: dict               # endpoint -> Baseline
    answers: dict            # (endpoint, name, stream) -> ((status, disaggregated answer), (status, colocated))
    decode_loaded: float     # KV tokens the decode node loaded from the store over the whole matrix


@pytest.fixture(scope="module", params=KINDS)
def served(request, tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp(f"parity-{request.param}") / "llama", "llama",
                            tokenizer=request.param)
    cluster = LocalCluster(str(model), ClusterSpec(prefill=1, decode=1, node_flags=NODE_FLAGS))
    with ThreadPoolExecutor(2) as pool:                     # start both at once: startup dominates
        started, node = pool.submit(cluster.start), pool.submit(NodeProcess, model, *NODE_FLAGS)
        try:
            started.result()
            colocated = node.result()
        except BaseException:
            cluster.stop()
            if node.done() and node.exception() is None:
                node.result().stop()
            raise
    try:
        base = _baseline(model, colocated.url)
        loaded_before = _loaded(cluster.decode_urls[0])
        answers = asyncio.run(_run_matrix(cluster.url, colocated.url, base))
        yield Served(request.param, base, answers, _loaded(cluster.decode_urls[0]) - loaded_before)
    finally:
        colocated.stop()
        cluster.stop()


@pytest.mark.parametrize("endpoint, name, stream", CASES,
                         ids=[f"{'chat' if e == CHAT else 'cmpl'}-{n}-{'sse' if s else 'json'}" for e, n, s in CASES])
def test_disaggregated_equals_colocated(served, endpoint, name, stream):
    (pd_status, pd), (co_status, co) = served.answers[(endpoint, name, stream)]
    assert (pd_status, co_status) == (200, 200), (pd, co)
    if stream:
        pd, co = by_choice(pd), by_choice(co)
    diffs = differences(pd, co)
    assert not diffs, "disaggregated vs colocated:\n" + "\n".join(diffs[:20])


def _loaded(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_kv_loaded_tokens_total{"))


def test_the_decode_node_loaded_kv_for_the_matrix(served):
    """The decode node loaded at least 8 tokens per case on average: parity covers the KV hand-off
    (with 16-token blocks the completions prompts were shorter than a block and nothing was loaded)."""
    assert served.decode_loaded >= 8 * len(CASES), served.decode_loaded


def test_the_matrix_exercises_what_it_claims(served):
    """The stop cases cut where they say; with Metaspace the first token is a "▁word" piece (its space)."""
    for endpoint in (CMPL, CHAT):
        t, body = served.base[endpoint].texts, cases(endpoint, served.base[endpoint])
        assert len(t[1]) and len(t[2]) < len(t[3]) and len(t[3]) < len(t[8]), t
        assert all(s for name in ("stop-first-token", "stop-inside-first-token", "stop-across-tokens",
                                  "stop-last-token") for s in body[name]["stop"])
        ok = [served.answers[(endpoint, name, False)][1][1]["choices"][0]["finish_reason"]
              for name in ("stop-first-token", "stop-across-tokens", "stop-last-token")]
        assert ok == ["stop"] * 3
        if served.kind == "metaspace":
            assert t[1].startswith(" ")
        colocated = {name: _text(served.answers[(endpoint, name, False)][1][1]) for name in KNOBS}
        assert colocated["logit-bias"] != t[8] and colocated["logit-bias-ban"] != t[6]
        assert 0 < served.base[endpoint].repeat_gap < 99
        for name in ("frequency-penalty", "presence-penalty", "penalties-logprobs"):   # they change the pushed
            assert colocated[name] != colocated["logit-bias"], name                     # token's repeats
    echo = served.answers[(CMPL, "echo-logprobs-max0", False)][1][1]
    choice, usage = echo["choices"][0], echo["usage"]
    assert choice["text"] == PROMPTS[CMPL] and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == usage["prompt_tokens"] and usage["completion_tokens"] == 0
    assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["prompt_logprobs"]) == usage["prompt_tokens"]
    chat = served.answers[(CHAT, "echo-last-message", False)][1][1]
    assert chat["choices"][0]["message"]["content"].startswith("Paris is the capital")
    assert len(served.answers[(CHAT, "prompt-logprobs", False)][1][1]["prompt_logprobs"]) > 10


STRUCTURED_CHECKS = {
    "json-schema": lambda t: set(json.loads(t)) == set(SCHEMA["required"]),
    "json-schema-seeded-n2": lambda t: set(json.loads(t)) == set(SCHEMA["required"]),
    "regex": lambda t: re.fullmatch(r"[a-z]{1,5}( [a-z]{1,5}){0,3}", t),
    "choice-seeded": lambda t: t in ("alpha", "beta gamma", "delta"),
    "grammar": lambda t: re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3}){0,2}\)", t),
    "guided-json-stop-string": lambda t: t.startswith('{"name": "') and '"kind"' not in t,
}


def test_structured_cases_are_constrained(served):
    """The structured cases' answers (both paths: they are equal above) match their constraint and end with
    "stop": the constraint was applied, on the prefill node's first token as on the decode node's."""
    for endpoint in (CMPL, CHAT):
        for name, check in STRUCTURED_CHECKS.items():
            for stream in (False, True):
                status, answer = served.answers[(endpoint, name, stream)][0]
                assert status == 200, answer
                for index, (text, finish) in _texts(answer, stream).items():
                    assert finish == "stop" and check(text), (endpoint, name, stream, index, text, finish)


def _texts(answer, stream: bool) -> dict[int, tuple[str, str]]:
    """{choice index: (text, finish_reason)} of a JSON answer or of a stream's events."""
    out: dict[int, tuple[str, str]] = {}
    choices = [c for event in answer for c in event["choices"]] if stream else answer["choices"]
    for c in choices:
        piece = c.get("text", None)
        if piece is None:
            piece = (c.get("delta") or c.get("message") or {}).get("content") or ""
        text, finish = out.get(c["index"], ("", None))
        out[c["index"]] = (text + piece, c.get("finish_reason") or finish)
    return out


def _baseline(model, colocated: str) -> dict[str, Baseline]:
    """Greedy texts after k tokens (from the colocated node), greedy ids and the first one's repeat gap (same
    engine, in process)."""
    llm = LLM(str(model))
    prompts = {CMPL: llm.tokenizer.encode(PROMPTS[CMPL]), CHAT: apply_chat_template(llm.tokenizer, PROMPTS[CHAT])}
    out = {}
    with httpx.Client(timeout=120) as client:
        for endpoint in (CMPL, CHAT):
            texts = {k: _text(client.post(colocated + endpoint, json={
                **prompt_field(endpoint), "max_tokens": k, "temperature": 0.0, "ignore_eos": True}).json())
                for k in TEXT_LENGTHS}
            [ids] = llm.generate([prompts[endpoint]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            first = ids.token_ids[0]
            [again] = llm.generate([prompts[endpoint] + [first]], SamplingParams(   # first's raw logprob after itself
                max_tokens=1, temperature=0.0, logprobs=1, logit_bias={first: 100.0}))
            gap = again.logprobs[0].top_logprobs[0][1] - again.logprobs[0].logprob
            out[endpoint] = Baseline(texts, ids.token_ids, gap)
    llm.shutdown()
    return out


async def _run_matrix(proxy: str, colocated: str, base: dict[str, Baseline]) -> dict:
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=300) as client:
        async def both(endpoint: str, body: dict, stream: bool):
            async with limit:
                body = {**body, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
                return await asyncio.gather(_ask(client, proxy + endpoint, body, stream),
                                            _ask(client, colocated + endpoint, body, stream))

        jobs = {(endpoint, name, stream): both(endpoint, body, stream)
                for endpoint in (CMPL, CHAT) for name, body in cases(endpoint, base[endpoint]).items()
                for stream in streams(name)}
        return dict(zip(jobs, await asyncio.gather(*jobs.values())))


async def _ask(client: httpx.AsyncClient, url: str, body: dict, stream: bool):
    if not stream:
        r = await client.post(url, json=body)
        return r.status_code, r.json()
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(await r.aread())
        lines = [line[len("data: "):] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    return 200, [json.loads(line) for line in lines[:-1]]


def _text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]
