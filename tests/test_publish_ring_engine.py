"""The publish ring inside a prefill engine (issue 38, item 5): a long prompt through a lagging or stuck store.

Two ``LLMEngine``s share one real store, slowed down (``SlowStore``); the prefill node's ring holds two chunks.
The whole prompt is computed in one step, so every chunk becomes publishable at once: the step waits for ring
slots (never more than the ring held), and the decode node's answer is HF's. With a store that stops answering, one
chunk waits ``wait_s`` and is skipped: the prefill node advertises only the chunks before it, the decode node
loads those and recomputes the rest -- the same tokens -- and a later prefill of the prompt publishes the rest.
"""

from __future__ import annotations

import threading

import pytest

from engine_run import run_request
from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.sampling_params import SamplingParams
from test_publish_ring import SlowStore

CHUNK, PROMPT = 32, 600
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _chunk_bytes(model_dir) -> int:
    return ModelConfig.from_dir(model_dir).kv_layout().bytes_per_token * CHUNK


def _engine(model_dir, role, store, layerwise=True):
    kv = KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=CHUNK,
                          kv_publish_buffer_bytes=2 * _chunk_bytes(model_dir), kv_publish_layerwise=layerwise)
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=2048), kv_transfer=kv)
    return LLMEngine(cfg, store=store)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return hf_model(tiny_llama)


@pytest.fixture(params=[True, False], ids=["layerwise", "per-step"])
def layerwise(request):
    return request.param


@pytest.fixture()
def store():
    s = SlowStore(delay_s=0.005)
    yield s
    s.gate.set()
    s.close()


def _prefill(engine, rid, prompt):
    _, out = run_request(engine, rid, prompt, SamplingParams(max_tokens=1, **GREEDY), {"do_remote_decode": True})
    return out.kv_transfer_params


def _decode(engine, rid, prompt, params):
    return run_request(engine, rid, prompt, SamplingParams(max_tokens=8, **GREEDY), params)


def test_a_long_prompt_waits_for_ring_slots_and_decodes_like_hf(tiny_llama, reference, store, layerwise):
    prompt = random_prompt(reference.config.vocab_size, PROMPT, seed=38)
    prefill, decode = _engine(tiny_llama, "prefill", store, layerwise), _engine(tiny_llama, "decode", store)
    params = _prefill(prefill, "p", prompt)
    stats, bound = prefill.connector.stats(), 2 * _chunk_bytes(tiny_llama)
    assert stats["publish_buffer_bytes"] == bound and stats["publish_buffer_peak_bytes"] == bound
    assert stats["publish_buffer_waits"] > 0 and stats["publish_buffer_skips"] == 0
    assert stats["publish_buffer_bytes_in_flight"] == 0
    assert decode.connector.stats()["publish_buffer_bytes"] == 0        # a decode node never publishes: no ring
    assert params["num_tokens"] == PROMPT
    tokens, out = _decode(decode, "d", prompt, params)
    assert tokens == hf_greedy(reference, prompt, 8)
    assert out.kv_accounting["loaded_tokens"] == PROMPT and decode.connector.loader.failures == 0


def test_a_stuck_store_skips_a_chunk_and_decode_recomputes_from_there(tiny_llama, reference, store, layerwise):
    prompt = random_prompt(reference.config.vocab_size, PROMPT, seed=39)
    prefill, decode = _engine(tiny_llama, "prefill", store, layerwise), _engine(tiny_llama, "decode", store)
    prefill.connector.publisher.ring.wait_s = 0.3
    store.gate.clear()
    opener = threading.Timer(1.0, store.gate.set)                        # the store answers again later
    opener.start()
    try:
        params = _prefill(prefill, "p", prompt)
    finally:
        opener.join()
    stats = prefill.connector.stats()
    assert stats["publish_buffer_skips"] == 1 and stats["publish_buffer_waits"] >= 1   # the last one timed out
    published = params["num_tokens"] // CHUNK
    assert params["num_tokens"] == published * CHUNK and 1 <= published <= 3   # in flight + the ring, then a gap
    assert store.lookup(params["chunk_keys"], prefill.layout.num_layers) == published
    tokens, out = _decode(decode, "d", prompt, params)
    assert tokens == hf_greedy(reference, prompt, 8)
    assert out.kv_accounting["loaded_tokens"] == published * CHUNK
    assert out.kv_accounting["recomputed_tokens"] == PROMPT + 1 - published * CHUNK
    again = _prefill(prefill, "p2", prompt)                                # publishes from the gap on
    assert again["num_tokens"] == PROMPT
    tokens, out = _decode(_engine(tiny_llama, "decode", store), "d2", prompt, again)   # no local prefix hit
    assert tokens == hf_greedy(reference, prompt, 8) and out.kv_accounting["loaded_tokens"] == PROMPT
