"""Exactness with the engine core in its own process (``pdserve node --engine-core-process``, issue 14).

One in-process ``--role both`` node is the reference. Against it, the P/D parity matrix
(``parity_matrix.cases``: completions and chat, streaming and not, n, logprobs, seeded sampling, stop
strings and ids, min_tokens, ...) is sent, all at once, to (1) a colocated node with the engine-core
process and (2) a disaggregated cluster (store daemon, prefill, decode, proxy) whose nodes both run
with it; every answer must equal the reference field by field. Greedy output also equals HF
transformers, for concurrent requests, and a stream abandoned mid-way frees its blocks in the core.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from conftest import NodeProcess
from hf_reference import hf_greedy, hf_model
from parity_matrix import CHAT, CMPL, NAMES, by_choice, cases, differences, streams
from polling import wait_until
from pdserve.engine.text.tokenizer import load_tokenizer
from pdserve.proxy.cluster import ClusterSpec, LocalCluster
from test_pd_parity import NODE_FLAGS, _ask, _baseline

CORE = ("--engine-core-process",)
CONCURRENCY = 8
CASES = [(endpoint, name, stream) for endpoint in (CMPL, CHAT) for name in NAMES[endpoint] for stream in streams(name)]
IDS = [f"{'chat' if e == CHAT else 'cmpl'}-{n}-{'sse' if s else 'json'}" for e, n, s in CASES]
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Every student never forgot three green apples",
           "Her younger brother bravely crossed the winter garden", "What is the capital of France?"]


@dataclass
class Served:
    reference: NodeProcess       # in-process engine
    core: NodeProcess            # --engine-core-process, colocated
    cluster: LocalCluster        # prefill + decode nodes with --engine-core-process, behind the proxy
    answers: dict                # case -> {"reference" | "core" | "disagg": (status, answer)}


@pytest.fixture(scope="module")
def served(tiny_llama):
    cluster = LocalCluster(str(tiny_llama), ClusterSpec(prefill=1, decode=1, node_flags=NODE_FLAGS + CORE))
    with ThreadPoolExecutor(3) as pool:                     # start all at once: start-up dominates
        jobs = [pool.submit(cluster.start), pool.submit(NodeProcess, tiny_llama, *NODE_FLAGS),
                pool.submit(NodeProcess, tiny_llama, *NODE_FLAGS, *CORE)]
    try:
        _, reference, core = [job.result() for job in jobs]
        base = _baseline(tiny_llama, reference.url)
        targets = {"reference": reference.url, "core": core.url, "disagg": cluster.url}
        yield Served(reference, core, cluster, asyncio.run(_run_matrix(targets, base)))
    finally:
        for job in jobs[1:]:
            if job.exception() is None:
                job.result().stop()
        cluster.stop()


async def _run_matrix(targets: dict[str, str], base) -> dict:
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=300) as client:
        async def each(endpoint: str, body: dict, stream: bool) -> dict:
            body = {**body, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
            async with limit:
                answers = await asyncio.gather(*[_ask(client, url + endpoint, body, stream)
                                                 for url in targets.values()])
            return dict(zip(targets, answers))

        jobs = {(endpoint, name, stream): each(endpoint, body, stream)
                for endpoint in (CMPL, CHAT) for name, body in cases(endpoint, base[endpoint]).items()
                for stream in streams(name)}
        return dict(zip(jobs, await asyncio.gather(*jobs.values())))


@pytest.mark.parametrize("endpoint, name, stream", CASES, ids=IDS)
@pytest.mark.parametrize("target", ["core", "disagg"])
def test_engine_core_process_equals_in_process(served, target, endpoint, name, stream):
    answers = served.answers[(endpoint, name, stream)]
    (ref_status, ref), (status, got) = answers["reference"], answers[target]
    assert (status, ref_status) == (200, 200), (got, ref)
    if stream:
        got, ref = by_choice(got), by_choice(ref)
    diffs = differences(got, ref)
    assert not diffs, f"{target} vs in-process:\n" + "\n".join(diffs[:20])


def test_concurrent_greedy_equals_hf(served, tiny_llama):
    tok, model = load_tokenizer(tiny_llama), hf_model(tiny_llama)
    expected = [tok.decode(hf_greedy(model, tok.encode(p), 12), skip_special_tokens=True) for p in PROMPTS]

    async def ask(client, prompt: str, stream: bool) -> str:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stream": stream}
        status, answer = await _ask(client, served.core.url + CMPL, body, stream)
        assert status == 200, answer
        return "".join(c["choices"][0]["text"] for c in (answer if stream else [answer]) if c["choices"])

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[ask(client, p, stream) for p in PROMPTS for stream in (False, True)])

    got = asyncio.run(main())
    assert got == [e for e in expected for _ in (False, True)]


def test_abandoned_stream_frees_its_blocks_in_the_core(served):
    url = served.core.url
    body = {"prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0.0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        total = _metric(client, url, "pdserve_kv_cache_num_blocks")
        with client.stream("POST", url + CMPL, json=body) as r:
            chunks = r.iter_lines()
            assert [next(chunks) for _ in range(6)]          # a few tokens arrived, then the client hangs up
            wait_until(lambda: _metric(client, url, "vllm:num_requests_running") == 1, 30, "the core reports it")
        wait_until(lambda: _metric(client, url, "vllm:num_requests_running") == 0
                   and _metric(client, url, "pdserve_kv_cache_free_blocks") == total, 30, "the aborted request freed")
        again = {**body, "max_tokens": 8, "stream": False}
        assert client.post(url + CMPL, json=again).json()["choices"][0]["text"] == \
            client.post(served.reference.url + CMPL, json=again).json()["choices"][0]["text"]


def test_a_stop_string_frees_its_blocks_in_the_core(served):
    """The API process finds the stop string (early in a request of 1500 tokens), answers like in-process and
    stops the request in the core: its blocks are freed long before its max_tokens could be reached."""
    url = served.core.url
    with httpx.Client(timeout=60) as client:
        total = _metric(client, url, "pdserve_kv_cache_num_blocks")
        probe = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        text = client.post(served.reference.url + CMPL, json=probe).json()["choices"][0]["text"]
        body = {**probe, "max_tokens": 1500, "stop": [text[-3:]], "stream": True,
                "stream_options": {"include_usage": True}}
        answers = [_ask_sync(client, target + CMPL, body) for target in (served.reference.url, url)]
        assert not differences(by_choice(answers[1]), by_choice(answers[0]))
        assert answers[1][-2]["choices"][0]["finish_reason"] == "stop"
        assert answers[1][-1]["usage"]["completion_tokens"] <= 6
        wait_until(lambda: _metric(client, url, "vllm:num_requests_running") == 0
                   and _metric(client, url, "pdserve_kv_cache_free_blocks") == total, 30, "the stopped request freed")


def _ask_sync(client: httpx.Client, url: str, body: dict) -> list[dict]:
    with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _metric(client: httpx.Client, url: str, name: str) -> float:
    for line in client.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")
