"""Prefill and decode with different TP/PP layouts share the TP/PP-agnostic store objects.

In-process engines share one memory store (like test_disagg_engine.py); the tp x pp engines keep
their KV cache in worker ranks, which gather / scatter their own layers and heads (parallel/kv.py).
Each pair's decode output equals HF greedy, the decode node really loaded the prompt (whole
blocks; the last prompt token is recomputed), and a tp2 prefill stores the single-rank objects:
bit-identical for layer 0 (no reduction before it), equal up to float summation order after it.
"""

from __future__ import annotations

import pytest
import torch

from engine_run import run_request
from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, ParallelConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.auth import process_key
from pdserve.kvstore.keys import object_key
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.seal import unseal
from pdserve.kvstore.tiered import TieredStore

LENGTH = 77                      # 2 full chunks of 32 + a partial one


def _engine(model_dir, role, store, tp=1, pp=1):
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                       kv_transfer=KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=32))
    return LLMEngine(cfg, store=store)


_run = run_request


def _prefill(engine, prompt):
    _, out = _run(engine, "p", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                  {"do_remote_decode": True})
    return out.kv_transfer_params


def _objects(store, params, num_layers):
    """The stored KV of every (chunk, layer), unsealed (the seal is checked on the way)."""
    keys = [object_key(c, layer) for c in params["chunk_keys"] for layer in range(num_layers)]
    return [unseal(k, obj, process_key().seal_key)[0] for k, obj in zip(keys, store.get(keys))]


@pytest.fixture(scope="module")
def case(tiny_llama):
    ref = hf_model(tiny_llama)
    prompt = random_prompt(ref.config.vocab_size, LENGTH, seed=11)
    store = TieredStore(MemoryTier(64 << 20))
    single = _engine(tiny_llama, "prefill", store)
    params = _prefill(single, prompt)
    objects = _objects(store, params, ref.config.num_hidden_layers)
    store.close()
    _check_against_hf(ref, prompt, objects, params["chunk_tokens"])
    return prompt, hf_greedy(ref, prompt, 8), objects, ref.config.num_hidden_layers


def _check_against_hf(ref, prompt, objects, chunk_tokens):
    """The single-rank objects the tp/pp layouts are compared with are themselves checked against an
    independent reference: HF transformers' own KV cache for the prompt (post-RoPE K, V)."""
    with torch.no_grad():
        cache = ref(torch.tensor([prompt]), use_cache=True).past_key_values
    num_layers = ref.config.num_hidden_layers
    for j, obj in enumerate(objects):                                    # chunk-major, then layer
        chunk, layer = divmod(j, num_layers)
        lo, hi = chunk * chunk_tokens, min(len(prompt), (chunk + 1) * chunk_tokens)
        hf = torch.stack([cache.layers[layer].keys[0], cache.layers[layer].values[0]])   # [2, Hkv, T, D]
        assert torch.allclose(obj, hf[:, :, lo:hi].transpose(1, 2), atol=1e-5), (chunk, layer)


@pytest.mark.parametrize("prefill_layout,decode_layout", [((1, 1), (2, 1)), ((2, 1), (1, 2))])
def test_mismatched_layouts_decode_like_single_rank(tiny_llama, case, prefill_layout, decode_layout):
    prompt, expected, single_objects, num_layers = case
    store = TieredStore(MemoryTier(64 << 20))
    engines = [_engine(tiny_llama, "prefill", store, *prefill_layout),
               _engine(tiny_llama, "decode", store, *decode_layout)]
    try:
        params = _prefill(engines[0], prompt)
        got = _objects(store, params, num_layers)
        for i, (g, w) in enumerate(zip(got, single_objects)):
            assert g.shape == w.shape and (torch.equal(g, w) if i % num_layers == 0 else torch.allclose(g, w, atol=1e-4))
        tokens, final = _run(engines[1], "d", prompt,
                             SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), params)
        assert tokens == expected
        assert final.kv_accounting["loaded_tokens"] == LENGTH // 8 * 8
        for e in engines:
            assert e.block_manager.num_free_blocks == e.runtime.num_blocks
    finally:
        for e in engines:
            e.shutdown()
        store.close()


def test_a_rank_copy_error_fails_that_chunk_not_the_node(tiny_llama, case):
    """The tp2 decode node's second chunk scatter fails on every rank (slots past the cache): the ranks
    answer with the error instead of dying, the load keeps chunk 1 (32 tokens), the rest is recomputed,
    and the output is still HF's."""
    prompt, expected, _, _ = case
    store = TieredStore(MemoryTier(64 << 20))
    engines = [_engine(tiny_llama, "prefill", store), _engine(tiny_llama, "decode", store, 2, 1)]
    decode = engines[1]
    relay, calls = decode.runner.kv_io, []
    scatter = relay.scatter

    def second_chunk_breaks(slots, data):
        calls.append(len(slots))
        scatter(slots + decode.runtime.num_blocks * 8 if len(calls) == 2 else slots, data)

    relay.scatter = second_chunk_breaks
    try:
        params = _prefill(engines[0], prompt)
        tokens, final = _run(decode, "d", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                             params)
        assert tokens == expected
        assert final.kv_accounting["loaded_tokens"] == 32 and len(calls) == 2
        assert decode.connector.stats()["load_failures"] == 1
        assert decode.runner.failure is None
        assert _run(decode, "again", prompt[:20], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
    finally:
        for e in engines:
            e.shutdown()
        store.close()
