"""Hostile review of layerwise publishing (``--kv-publish-layerwise``): each test reproduces a finding on real engines
(the tiny llama) over a real in-memory ``TieredStore``; the per-step path is the oracle."""

from __future__ import annotations

import pytest

from engine_run import run_request
from hf_reference import hf_model, random_prompt
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.keys import chunk_keys, object_key
from test_publish_layerwise import ECHUNK, GREEDY, _engine, stores  # noqa: F401 - the fixture


@pytest.fixture(scope="module")
def vocab(tiny_llama):
    return hf_model(tiny_llama).config.vocab_size


def _fail_first_gather(io, name):
    """The first gather of chunk 0 (per step: ``gather``; layerwise: its layer 0) raises, as a device fault would."""
    real, calls = getattr(io, name), []

    def gather(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: the gather of chunk 0 failed")
        return real(*args, **kwargs)
    setattr(io, name, gather)


@pytest.mark.parametrize("layerwise,budget", [(False, 40), (True, 40), (True, 2048)])   # one chunk a step; all in one
def test_a_failed_gather_publishes_nothing_after_the_gap(tiny_llama, vocab, stores, layerwise, budget):
    """Finding 1: a gather that raised ended its chunk unpublished but left the request publishing, so every later
    chunk went to the store (and through the ring) after a gap no decode node may use; the per-step path stops."""
    prompt, store = random_prompt(vocab, 100, seed=11), stores()
    prefill = _engine(tiny_llama, "prefill", store, layerwise=layerwise, budget=budget)
    _fail_first_gather(prefill.connector.publisher.io, "gather_layer" if layerwise else "gather")
    _, out = run_request(prefill, "p", prompt, SamplingParams(max_tokens=1, **GREEDY), {"do_remote_decode": True})
    assert not out.kv_transfer_params.get("chunk_digests")           # nothing for a decode node to load
    keys = chunk_keys(prompt, ECHUNK, prefill.connector.fingerprint, include_partial=True)
    n = prefill.layout.num_layers
    later = [object_key(k, i) for k in keys[1:] for i in range(n)]
    assert not any(store.contains(later)), "chunks after the failed one were published"
    assert prefill.connector.stats()["publish_failures"] == 1
