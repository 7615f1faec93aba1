"""A node that both loads and publishes layer by layer (role ``both``, ``--kv-load-layerwise`` and
``--kv-publish-layerwise``): when the step's load fails, what that step computed on the partial cache is never
published -- the request's later chunks reach the store only from the recomputed step.

Mutation caught: ``StoreConnector.begin_step`` taking the chunks of a request whose layerwise load runs in the same
step -> the tail's later layers, computed on attention over a cache without the lost layer-0 object, are put during
the forward (a failed put and then a good one: a reader in between loads wrong KV under a valid seal).
"""

from __future__ import annotations

import pytest
import torch

from engine_run import run_request
from hf_reference import hf_greedy, hf_model, random_prompt
from test_kv_load_layerwise import GREEDY, KEY, _lose_after_lookup
from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.keys import chunk_keys, object_key
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.seal import unseal
from pdserve.kvstore.tiered import TieredStore

CHUNK = 16


def _engine(model_dir, store, layerwise: bool):
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=2048),
                       kv_transfer=KVTransferConfig(role="both", kv_store="embedded", kv_chunk_tokens=CHUNK,
                                                    kv_load_layerwise=layerwise, kv_publish_layerwise=layerwise))
    return LLMEngine(cfg, store=store)


def _objects(store, keys, layers):
    return [unseal(object_key(k, layer), store.get([object_key(k, layer)])[0], KEY)[0].clone()
            for k in keys for layer in layers]


def _record_puts(store, watched: set[str]) -> list:
    """Every (key, unsealed KV) put under a watched key, as it is put."""
    seen, real = [], store.adopt                   # the publisher hands its sealed objects over with ``adopt``

    def adopt(items, *args, **kwargs):
        items = list(items)
        seen.extend((k, unseal(k, obj, KEY)[0].clone()) for k, obj in items if k in watched)
        return real(items, *args, **kwargs)

    store.adopt = adopt
    return seen


def test_a_failed_layerwise_load_publishes_nothing_from_its_step(tiny_llama):
    ref_model = hf_model(tiny_llama)
    layers = range(ref_model.config.num_hidden_layers)
    head = random_prompt(ref_model.config.vocab_size, 40, seed=31)
    prompt = head[:32] + random_prompt(ref_model.config.vocab_size, 30, seed=32)      # chunks 0, 1 in the store
    clean, store = TieredStore(MemoryTier(256 << 20)), TieredStore(MemoryTier(256 << 20))
    try:
        for s in (clean, store):                       # the shared head, published by an earlier request
            e = _engine(tiny_llama, s, layerwise=False)
            run_request(e, "head", head, SamplingParams(max_tokens=1, **GREEDY))
            e.shutdown()
        e = _engine(tiny_llama, clean, layerwise=False)
        run_request(e, "want", prompt, SamplingParams(max_tokens=1, **GREEDY))
        e.shutdown()
        keys = chunk_keys(prompt, CHUNK, e.connector.fingerprint, include_partial=True)
        want = _objects(clean, keys[2:4], layers)

        _lose_after_lookup(store, keys[1], 0)            # chunk 1 fails at layer 0: the tail's layer-1 K/V is wrong
        puts = _record_puts(store, {object_key(k, layer) for k in keys[2:4] for layer in layers})
        lw = _engine(tiny_llama, store, layerwise=True)
        tokens, out = run_request(lw, "r", prompt, SamplingParams(max_tokens=4, **GREEDY))
        assert tokens == hf_greedy(ref_model, prompt, 4) and out.finish_reason == "length"
        assert lw.connector.loader.failures == 1
        lw.shutdown()
        got = _objects(store, keys[2:4], layers)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        wanted = dict(zip((object_key(k, layer) for k in keys[2:4] for layer in layers), want))
        assert puts and all(torch.equal(view, wanted[key]) for key, view in puts)   # no put ever held other KV
    finally:
        clean.close()
        store.close()
