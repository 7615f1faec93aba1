"""schemathesis against the node's and the proxy's OpenAPI schemas (``/openapi.json``), live processes on
127.0.0.1 with a tiny llama: valid and invalid requests to every operation, a bounded example budget.

No answer is a 5xx, no process dies, ``/health`` is 200 afterwards on both, and a greedy request returns
the text it returned before the fuzzing. The budget keeps the module near a minute on two cores; raise
``PDSERVE_FUZZ_EXAMPLES`` for a longer run (say 2000).

Before: the node served no schema (``openapi_url=None``) and the proxy's routes had no request body in
theirs; against hand-written cases the same classes failed -- NaN / Infinity temperatures (a 500 from
the proxy re-serialising them), seeds past 2^64, stop ids past the vocabulary, nested JSON (``test_hostile_requests``).
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from test_proxy_support import proxy_factory  # noqa: F401 - fixture

DEFAULT_EXAMPLES = 300                  # per process; CI runs the same ones every time
EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
GREEDY = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def node(node_factory, tiny_llama):
    return node_factory(tiny_llama, "--max-model-len", "64", "--num-gpu-blocks-override", "64", "--max-num-seqs", "32")


@pytest.fixture(scope="module")
def proxy(tiny_llama, node, proxy_factory):  # noqa: F811
    return proxy_factory(tiny_llama, [node.url], [node.url])


def _greedy(base: str) -> str:
    response = httpx.post(base + "/v1/completions", json=GREEDY, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _focus(drop: tuple[str, ...]):
    """Drop generated fields that would only ever meet one check: a random ``model`` (404), and at the
    proxy the P/D fields only nodes take (refused by name)."""
    def focus(case):
        if isinstance(case.body, dict):
            for name in drop:
                case.body.pop(name, None)
        return case
    return focus


def _fuzz(base: str, examples: int, drop: tuple[str, ...]) -> dict[int, int]:
    """``examples`` cases over every operation of ``base``'s schema, half of them invalid on purpose."""
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    cases = cases.map(_focus(drop))
    statuses: dict[int, int] = {}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=EXAMPLES == DEFAULT_EXAMPLES,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case) -> None:
        response = case.call(base_url=base, timeout=120)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, f"{case.as_curl_command()} -> {response.status_code} {response.text[:500]}"

    run()
    return statuses


def test_fuzzing_the_node_and_the_proxy_finds_no_5xx_and_leaves_them_serving(node, proxy):
    before = _greedy(node.url)
    assert _greedy(proxy.url) == before
    for base, drop in ((node.url, ("model",)), (proxy.url, ("model", "prompt_token_ids", "kv_transfer_params"))):
        statuses = _fuzz(base, EXAMPLES, drop)
        assert 200 in statuses and 400 in statuses, statuses        # both kinds of case reached the API
    assert node.proc.poll() is None and proxy.proc.poll() is None
    assert httpx.get(node.url + "/health").status_code == 200
    assert httpx.get(proxy.url + "/health").status_code == 200
    assert _greedy(node.url) == before and _greedy(proxy.url) == before
