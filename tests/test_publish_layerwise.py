"""Layerwise publish (``--kv-publish-layerwise``): a step's chunks go to the store layer by layer during the forward.

Engine level (real ``LLMEngine``s on the tiny llama, a real in-memory ``TieredStore``): the objects a layerwise
prefill stores are the bytes the per-step path stores (read back, unsealed, compared), a decode node loading them
answers as a colocated node does, and layer 0 really reaches the store before the last layer runs (the last layer
waits for it, with a deadline: on the per-step path it never comes). A store failure mid-step and a forward that
raises mid-step leave what the per-step path leaves. Publisher level (``ChunkPublisher`` + ``LayerwisePublish``,
the test thread playing the model): a stuck ring skips, an abort between two layers and a reused request id settle
the entry each chunk was queued under (tests/test_review38.py finding 1).
"""

from __future__ import annotations

import argparse
import threading
import time

import pytest
import torch

from engine_run import run_request
from hf_reference import hf_model, random_prompt
from polling import wait_until
from pdserve.engine import node
from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.keys import chunk_keys, object_key
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.seal import unseal
from pdserve.kvstore.tiered import TieredStore
from pdserve.prefill.layerwise import LayerwisePublish
from pdserve.prefill.publisher import ChunkPublisher
from pdserve.proxy import serve
from test_publish_ring import CHUNK, CHUNK_BYTES, KEY, L, SlowStore, _cache, _finished, _slots

GREEDY = dict(temperature=0.0, ignore_eos=True)
ECHUNK = 32                                              # the engines' --kv-chunk-tokens


class RecordingStore(TieredStore):
    """A real in-memory store that notes every adopt (when, which keys); ``down_at``: the first put that holds this
    key fails, and so does every put after it (a store that went down mid-step)."""

    def __init__(self):
        super().__init__(MemoryTier(256 << 20))
        self.adopts: list[tuple[float, list[str]]] = []
        self.down_at, self.down = None, False
        self.first_put = threading.Event()

    def adopt(self, items):
        keys = [k for k, _ in items]
        self.adopts.append((time.monotonic(), keys))
        self.first_put.set()
        self.down = self.down or self.down_at in keys
        if self.down:
            raise ConnectionError("injected: the store went down")
        super().adopt(items)


@pytest.fixture()
def stores():
    made = []

    def make():
        made.append(RecordingStore())
        return made[-1]
    yield make
    for s in made:
        s.close()


@pytest.fixture(scope="module")
def vocab(tiny_llama):
    return hf_model(tiny_llama).config.vocab_size


def _engine(model_dir, role, store, layerwise=True, budget=2048):
    kv = KVTransferConfig(role=role, kv_store="embedded" if store is not None else None, kv_chunk_tokens=ECHUNK,
                          kv_publish_layerwise=layerwise)
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget), kv_transfer=kv)
    return LLMEngine(cfg, store=store)


def _prefill(engine, rid, prompt):
    _, out = run_request(engine, rid, prompt, SamplingParams(max_tokens=1, **GREEDY), {"do_remote_decode": True})
    return out.kv_transfer_params


def _objects(store, params, num_layers):
    keys = [object_key(k, i) for k in params["chunk_keys"][:params["num_tokens"] // ECHUNK + 1] for i in range(num_layers)]
    return dict(zip(keys, store.get(keys)))


@pytest.mark.parametrize("budget", [2048, 100])          # the whole prompt in one step; chunks ending mid-step
def test_layerwise_objects_are_the_per_step_bytes_and_decode_matches_colocated(tiny_llama, vocab, stores, budget):
    prompt = random_prompt(vocab, 300, seed=budget)
    per_step, layerwise = stores(), stores()
    p_params = _prefill(_engine(tiny_llama, "prefill", per_step, layerwise=False, budget=budget), "p", prompt)
    prefill = _engine(tiny_llama, "prefill", layerwise, budget=budget)
    l_params = _prefill(prefill, "p", prompt)
    n = prefill.layout.num_layers
    assert l_params == p_params and l_params["num_tokens"] == 300 and len(l_params["chunk_digests"]) == 10
    assert {len(keys) for _, keys in per_step.adopts} == {n}              # per step: a chunk's layers at once
    assert max(len(keys) for _, keys in layerwise.adopts) <= n            # layerwise: what was queued, <= n
    want, got = _objects(per_step, p_params, n), _objects(layerwise, l_params, n)
    assert len(got) == 10 * n and want.keys() == got.keys()
    for key, obj in got.items():
        assert torch.equal(obj, want[key]), key                           # sealed bytes, MAC included
        assert torch.equal(unseal(key, obj, KEY)[0], unseal(key, want[key], KEY)[0])
    colocated, _ = run_request(_engine(tiny_llama, "both", None), "c", prompt, SamplingParams(max_tokens=8, **GREEDY))
    tokens, out = run_request(_engine(tiny_llama, "decode", layerwise), "d", prompt,
                              SamplingParams(max_tokens=8, **GREEDY), l_params)
    assert tokens == colocated and out.kv_accounting["loaded_tokens"] == 296   # whole blocks
    assert prefill.connector.stats()["publish_buffer_bytes_in_flight"] == 0


def test_layer_0_reaches_the_store_before_the_last_layer_runs(tiny_llama, vocab, stores):
    store = stores()
    prefill = _engine(tiny_llama, "prefill", store)
    started = []

    def last_layer_starts(module, args):                  # give the publisher thread its chance, with a deadline
        store.first_put.wait(10)
        started.append(time.monotonic())
    prefill.runner.model.layers[-1].input_norm.register_forward_pre_hook(last_layer_starts)
    params = _prefill(prefill, "p", random_prompt(vocab, 64, seed=1))
    assert params["num_tokens"] == 64
    layer0 = [t for t, keys in store.adopts for k in keys if k.endswith(":0")]
    assert len(layer0) == 2 and layer0[0] < started[0]    # chunk 0's layer 0 was put while layer 1 had not begun


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_store_failure_mid_step_publishes_the_chunks_before_it(tiny_llama, vocab, stores, layerwise):
    prompt, store = random_prompt(vocab, 200, seed=5), stores()
    prefill = _engine(tiny_llama, "prefill", store, layerwise=layerwise)
    keys = chunk_keys(prompt, ECHUNK, prefill.connector.fingerprint, include_partial=True)
    store.down_at = object_key(keys[3], 1)                 # down from chunk 3's last layer on
    params = _prefill(prefill, "p", prompt)
    published = len(params["chunk_digests"])               # per step: 3; layerwise: as many as went before it
    assert published <= 3 and published == 3 or layerwise
    assert params["num_tokens"] == published * ECHUNK and store.lookup(keys, 2) == published
    assert prefill.connector.stats()["publish_failures"] >= 1
    store.down = False                                      # back up for the decode node
    colocated, _ = run_request(_engine(tiny_llama, "both", None), "c", prompt, SamplingParams(max_tokens=6, **GREEDY))
    tokens, out = run_request(_engine(tiny_llama, "decode", store), "d", prompt,
                              SamplingParams(max_tokens=6, **GREEDY), params)
    assert tokens == colocated and out.kv_accounting["loaded_tokens"] == published * ECHUNK


def test_a_forward_that_raises_after_layer_0_gives_every_slot_back(tiny_llama, vocab, stores):
    store = stores()
    prefill = _engine(tiny_llama, "prefill", store)
    fail = [True]

    def boom(module, args):
        if fail.pop() if fail else False:
            raise RuntimeError("injected failure in the last layer")
    prefill.runner.model.layers[-1].input_norm.register_forward_pre_hook(boom)
    prompt = random_prompt(vocab, 100, seed=7)
    _, out = run_request(prefill, "p", prompt, SamplingParams(max_tokens=1, **GREEDY), {"do_remote_decode": True})
    assert out.finish_reason == "abort"                  # failed with the step
    ring = prefill.connector.publisher.ring
    wait_until(lambda: ring.bytes_in_flight == 0, 10, "the abandoned chunks' slots back")
    assert store.lookup(chunk_keys(prompt, ECHUNK, prefill.connector.fingerprint), 2) == 0   # layer 0 only
    params = _prefill(prefill, "p", prompt)                # the same id again: published whole
    assert params["num_tokens"] == 100 and store.lookup(params["chunk_keys"], 2) == 4


# -- publisher level: the test thread plays the engine thread and the model --------------------------------------

def _step(pub, chunks, skips=()):
    hooks = LayerwisePublish(pub, chunks, list(skips))
    for i in range(L):
        hooks.after(i)
    hooks.finish()


def test_a_stuck_ring_skips_the_chunk_and_publishes_nothing_after_it():
    store, src, slots = SlowStore(), _cache(seed=2), _slots(3 * CHUNK, seed=2)
    pub = ChunkPublisher(store, src, 0, TierHealth("t"), KEY, chunk_tokens=CHUNK, buffer_bytes=CHUNK_BYTES, wait_s=0.3)
    store.gate.clear()                                     # the store stops answering
    try:
        busy = threading.Event()                           # the publisher thread busy until chunk 0's layers all
        pub._queue.put(busy.wait)                          # queued: they go in one put, sealed (out of the slot)
        _step(pub, [pub.start_layers("a", 0, "s-0", slots[:CHUNK])])   # first; else layers 1.. wait in the slot
        busy.set()                                         # behind layer 0's stuck put (test_review_publish)
        wait_until(lambda: pub.ring.bytes_in_flight == 0, 10, "chunk 0 sealed (its put waits), its slot back")
        _step(pub, [pub.start_layers("a", 1, "s-1", slots[CHUNK:2 * CHUNK])])   # queued behind it: holds the slot
        started = time.monotonic()
        assert pub.start_layers("a", 2, "s-2", slots[2 * CHUNK:]) is None      # waited wait_s, then gave up
        assert time.monotonic() - started >= 0.3
        _step(pub, [], [("a", 2, "s-2")])
        store.gate.set()
        pub.close_request("a")
        result = _finished(pub, "a")
    finally:
        store.gate.set()
        pub.stop()
    assert (result.chunks, result.failed, sorted(result.digests)) == (2, True, [0, 1])
    assert store.lookup(["s-0", "s-1", "s-2"], L) == 2
    store.close()
    assert pub.buffer_stats()["publish_buffer_skips"] == 1 and pub.ring.bytes_in_flight == 0


def test_an_abort_between_two_layers_and_a_reused_id_settle_their_own_entries():
    store, src, slots = SlowStore(), _cache(seed=3), _slots(CHUNK, seed=3)
    pub = ChunkPublisher(store, src, 0, TierHealth("t"), KEY, chunk_tokens=CHUNK, buffer_bytes=2 * CHUNK_BYTES)
    store.gate.clear()
    try:
        old = pub.start_layers("x", 0, "old-0", slots)
        hooks = LayerwisePublish(pub, [old], [])
        hooks.after(0)
        pub.forget("x")                                   # aborted while its layers are on their way
        for i in range(1, L):
            hooks.after(i)
        hooks.finish()
        _step(pub, [pub.start_layers("x", 0, "new-0", slots)])          # a new request with the same id
        pub.close_request("x")
        store.gate.set()
        result = _finished(pub, "x")
    finally:
        store.gate.set()
        pub.stop()
    assert result.chunks == 1 and not result.failed
    assert store.lookup(["old-0"], L) == 1 and store.lookup(["new-0"], L) == 1   # queued chunks are still put
    store.close()


def test_the_flag_reaches_the_config_and_serve_passes_it(tmp_path):
    parser = argparse.ArgumentParser()
    node.register(parser.add_subparsers())
    base = ["node", "--model", str(tmp_path), "--kv-store", "embedded"]
    assert node.config_from_args(parser.parse_args(base)).kv_transfer.kv_publish_layerwise is True
    off = parser.parse_args(base + ["--no-kv-publish-layerwise"])
    assert node.config_from_args(off).kv_transfer.kv_publish_layerwise is False
    sp = argparse.ArgumentParser().add_subparsers()
    serve.register(sp)
    args = sp.choices["serve"].parse_args(["--no-kv-publish-layerwise"])
    assert "--no-kv-publish-layerwise" in serve.node_flags(args)
