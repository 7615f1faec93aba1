"""cache_salt in an engine with a KV store: tenants never hit each other's prefix cache or store chunks.

Two ``LLMEngine``s (role both: each publishes its prompts and looks the store up) share one in-memory
store, so a hit in the second engine can only come from the store, a hit in the first from its own cache.
"""

from __future__ import annotations

import asyncio

import pytest

from engine_run import run_request

from hf_reference import random_prompt
from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore

BLOCK, CHUNK, LENGTH = 8, 16, 70          # 8 whole blocks; 5 chunks (the last partial, published too)
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def store():
    s = TieredStore(MemoryTier(64 << 20))
    yield s
    s.close()


@pytest.fixture(scope="module")
def engines(tiny_llama, store):
    cfg = EngineConfig(model=str(tiny_llama), cache=CacheConfig(block_size=BLOCK),
                       kv_transfer=KVTransferConfig(role="both", kv_store="embedded", kv_chunk_tokens=CHUNK))
    first, second = LLMEngine(cfg, store=store), LLMEngine(cfg, store=store)
    yield first, second
    for e in (first, second):
        e.shutdown()


def _run(engine: LLMEngine, rid: str, prompt: list[int], salt: str | None):
    return run_request(engine, rid, prompt, PARAMS, cache_salt=salt)


def _figures(final) -> tuple[int, int, int]:
    acc = final.kv_accounting
    return final.num_cached_tokens, acc["local_hit_tokens"], acc["store_hit_tokens"]


def test_tenants_share_neither_the_prefix_cache_nor_the_store(engines, tiny_llama):
    first, second = engines
    prompt = random_prompt(512, LENGTH, seed=11)
    alice, alice_out = _run(first, "a1", prompt, "alice")
    assert _figures(alice_out) == (0, 0, 0)
    bob, bob_out = _run(first, "b1", prompt, "bob")                  # alice's blocks are cached and stored
    assert _figures(bob_out) == (0, 0, 0) and bob == alice          # isolated, and the same greedy tokens
    _, again = _run(first, "a2", prompt, "alice")                   # the same salt still hits
    assert again.num_cached_tokens == again.kv_accounting["local_hit_tokens"] == LENGTH // BLOCK * BLOCK
    _, carol = _run(second, "c1", prompt, "carol")                  # nobody published carol's chunks
    assert _figures(carol) == (0, 0, 0)
    _, alice_there = _run(second, "a3", prompt, "alice")            # another engine: alice's store chunks
    assert alice_there.kv_accounting["local_hit_tokens"] == 0
    assert alice_there.kv_accounting["store_hit_tokens"] == LENGTH
    assert alice_there.kv_accounting["loaded_tokens"] > 0
    for e in (first, second):
        assert e.block_manager.num_free_blocks == e.runtime.num_blocks
        e.block_manager.check_integrity()


def test_no_salt_behaves_as_before_and_is_its_own_tenant(engines):
    first, second = engines
    prompt = random_prompt(512, LENGTH, seed=12)
    _, salted = _run(first, "s1", prompt, "alice")
    _, plain = _run(first, "n1", prompt, None)                      # a salt's KV is not an unsalted request's
    assert _figures(plain) == (0, 0, 0)
    _, plain_again = _run(first, "n2", prompt, None)
    assert plain_again.num_cached_tokens == LENGTH // BLOCK * BLOCK
    _, from_store = _run(second, "n3", prompt, None)
    assert from_store.kv_accounting["store_hit_tokens"] == LENGTH


@pytest.mark.parametrize("core_process", [False, True])
def test_async_engine_passes_the_salt_to_the_engine(tiny_llama, core_process):
    """The path the node's handlers take (``AsyncEngine.submit``), in-process and through the engine core."""
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), cache=CacheConfig(block_size=BLOCK),
                                      engine_core_process=core_process))
    prompt = random_prompt(512, LENGTH, seed=13)

    async def cached(rid: str, salt: str | None) -> int:
        final = None
        async for out in engine.generate(prompt, PARAMS, rid, cache_salt=salt):
            final = out
        return final.num_cached_tokens

    async def scenario() -> list[int]:
        return [await cached(rid, salt) for rid, salt in (("a1", "alice"), ("b1", "bob"), ("a2", "alice"))]

    try:
        assert asyncio.run(scenario()) == [0, 0, LENGTH // BLOCK * BLOCK]
    finally:
        engine.shutdown()
