"""Hostile review of layerwise publishing (``--kv-publish-layerwise``): each test reproduces a finding on real engines
(the tiny llama) over a real in-memory ``TieredStore``; the per-step path is the oracle."""

from __future__ import annotations

import threading

import pytest
import torch

from engine_run import run_request
from hf_reference import hf_model, random_prompt
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.keys import chunk_keys, object_key
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore
from pdserve.prefill.layerwise import LayerwisePublish
from pdserve.prefill.publisher import ChunkPublisher
from test_publish_layerwise import ECHUNK, GREEDY, _engine, stores  # noqa: F401 - the fixture
from test_publish_ring import CHUNK, CHUNK_BYTES, KEY, L, _cache, _finished, _slots


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


def _engine_ring(model_dir, store, layerwise, slots, budget):
    from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
    from pdserve.engine.core.llm_engine import LLMEngine
    probe = _engine(model_dir, "both", None, layerwise=False)
    chunk_bytes = probe.layout.bytes_per_token * ECHUNK
    probe.shutdown()
    kv = KVTransferConfig(role="prefill", kv_store="embedded", kv_chunk_tokens=ECHUNK,
                          kv_publish_layerwise=layerwise, kv_publish_buffer_bytes=slots * chunk_bytes)
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget), kv_transfer=kv)
    return LLMEngine(cfg, store=store)


def _run_all(engine, requests):
    """Add every (id, prompt, params) at once (one step runs them together) -> {id: final output}."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params, {"do_remote_decode": True})
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


@pytest.mark.parametrize("budget", [2048, 72])
def test_two_requests_a_small_ring_and_prompt_logprobs_store_the_per_step_bytes(tiny_llama, vocab, stores, budget):
    """Held up: two requests in one step (one with prompt_logprobs: the every-row forward), a ring of 2 slots for a
    step completing up to 7 chunks -- the same objects, digests and results as per step."""
    a, b = random_prompt(vocab, 130, seed=21), random_prompt(vocab, 100, seed=22)
    reqs = [("a", a, SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY)),
            ("b", b, SamplingParams(max_tokens=1, **GREEDY))]
    got = {}
    for layerwise in (False, True):
        store = stores()
        engine = _engine_ring(tiny_llama, store, layerwise, 2, budget)
        finals = _run_all(engine, reqs)
        n = engine.layout.num_layers
        keys = [object_key(k, i) for p in (a, b) for k in chunk_keys(p, ECHUNK, engine.connector.fingerprint,
                                                                     include_partial=True) for i in range(n)]
        got[layerwise] = ({r: f.kv_transfer_params for r, f in finals.items()}, dict(zip(keys, store.get(keys))))
        assert engine.connector.stats()["publish_buffer_bytes_in_flight"] == 0
        engine.shutdown()
    (p_params, p_objs), (l_params, l_objs) = got[False], got[True]
    assert l_params == p_params and l_params["a"]["num_tokens"] == 130 and l_params["b"]["num_tokens"] == 100
    assert p_objs.keys() == l_objs.keys() and all(torch.equal(p_objs[k], l_objs[k]) for k in p_objs)


@pytest.fixture()
def redis_prefix():
    import uuid

    import redis
    client = redis.Redis.from_url("redis://127.0.0.1:6379", socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis on 127.0.0.1:6379: {exc}")
    prefix = "trp" + uuid.uuid4().hex[:12] + ":"
    yield prefix
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)


def test_durable_layerwise_over_real_redis_decodes_as_colocated(tiny_llama, vocab, redis_prefix):
    """Held up: an embedded store over real Redis (durable: every chunk flushed before it counts), chunks ending
    mid-step; a decode node with its own embedded store reads them from Redis and answers as a colocated node."""
    from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
    from pdserve.engine.core.llm_engine import LLMEngine


    def node(role, layerwise):
        kv = KVTransferConfig(role=role, kv_redis="redis://127.0.0.1:6379", kv_redis_prefix=redis_prefix,
                              kv_auth_token="review-publish-cluster-secret",   # the cluster's key, both nodes
                              kv_chunk_tokens=ECHUNK, kv_publish_layerwise=layerwise)
        return LLMEngine(EngineConfig(model=str(tiny_llama), cache=CacheConfig(block_size=8),
                                      scheduler=SchedulerConfig(max_num_batched_tokens=100), kv_transfer=kv))
    prompt, params = random_prompt(vocab, 150, seed=31), SamplingParams(max_tokens=6, **GREEDY)
    prefill = node("prefill", True)
    assert prefill.connector.publisher.durable and prefill.connector.publish_layerwise
    _, out = run_request(prefill, "p", prompt, SamplingParams(max_tokens=1, **GREEDY), {"do_remote_decode": True})
    l_params = out.kv_transfer_params
    prefill.shutdown()
    assert l_params["num_tokens"] == 150 and len(l_params["chunk_digests"]) == 5
    colocated, _ = run_request(_engine(tiny_llama, "both", None), "c", prompt, params)
    decode = node("decode", False)
    tokens, dout = run_request(decode, "d", prompt, params, l_params)
    decode.shutdown()
    assert tokens == colocated and dout.kv_accounting["loaded_tokens"] == 144


class _GatedStore(TieredStore):
    """A real in-memory store: each put first waits for ``gate`` (``entered`` set while one waits); a put holding a key
    that starts with ``fail_prefix`` raises (the store went away for it)."""

    def __init__(self, fail_prefix: str):
        super().__init__(MemoryTier(64 << 20))
        self.gate, self.entered, self.fail_prefix = threading.Event(), threading.Event(), fail_prefix

    def adopt(self, items):
        self.entered.set()
        self.gate.wait()
        if any(k.startswith(self.fail_prefix) for k, _ in items):
            raise ConnectionError("injected: the put failed")
        super().adopt(items)


def test_a_failed_put_of_two_chunks_layers_counts_each_lost_chunk():
    """Finding 2: layer objects of two chunks that queued up while the store lagged go in one put; when it failed,
    both chunks were lost but ``publish_failures`` counted one (and nothing was counted as skipped) -- per step each
    lost chunk is counted, as a failure or a skip."""
    store, src = _GatedStore("a-0"), _cache(seed=4)
    slots = _slots(3 * CHUNK, seed=4)
    pub = ChunkPublisher(store, src, 0, TierHealth("t"), KEY, chunk_tokens=CHUNK, buffer_bytes=3 * CHUNK_BYTES)
    try:
        warm = LayerwisePublish(pub, [pub.start_layers("w", 0, "w-0", slots[:CHUNK])], [])
        warm.after(0)
        assert store.entered.wait(10)                      # the publisher is in the put of w's layer 0: the rest queue
        warm.finish()
        both = [pub.start_layers("a", 0, "a-0", slots[CHUNK:2 * CHUNK]),
                pub.start_layers("b", 0, "b-0", slots[2 * CHUNK:])]
        hooks = LayerwisePublish(pub, both, [])
        for i in range(L):
            hooks.after(i)
        hooks.finish()
        store.gate.set()
        for rid in "wab":
            pub.close_request(rid)
        results = _finished(pub, "w", "a", "b")
    finally:
        store.gate.set()
        pub.stop()
    assert [r.chunks for r in results] == [1, 0, 0]
    assert pub.failures + pub.skipped == 2, (pub.failures, pub.skipped)     # a and b: each lost chunk counted
    store.close()


@pytest.mark.parametrize("arch,shape", [("deepseek_v3", {"q_lora_rank": 24}), ("deepseek_v2", {})])
def test_deepseek_mla_layerwise_objects_are_the_per_step_bytes(tmp_path, arch, shape):
    """Held up: DeepSeek (MLA cache, a dense then an MoE layer) runs the llama layer loop, so its hooks are called
    and it publishes layer by layer too; the objects are the per-step bytes."""
    from pdserve.engine.checkpoints.tiny_deepseek import make_tiny_deepseek
    from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
    from pdserve.engine.core.llm_engine import LLMEngine
    from test_publish_layerwise import RecordingStore

    model = make_tiny_deepseek(tmp_path / arch, arch, seed=4, num_layers=2, **shape)
    prompt = random_prompt(hf_model(model).config.vocab_size, 77, seed=12)
    got = {}
    for layerwise in (False, True):
        store = RecordingStore()
        kv = KVTransferConfig(role="prefill", kv_store="embedded", kv_chunk_tokens=ECHUNK,
                              kv_publish_layerwise=layerwise)
        engine = LLMEngine(EngineConfig(model=str(model), cache=CacheConfig(block_size=8),
                                        scheduler=SchedulerConfig(max_num_batched_tokens=40), kv_transfer=kv),
                           store=store)
        _, out = run_request(engine, "p", prompt, SamplingParams(max_tokens=1, **GREEDY), {"do_remote_decode": True})
        keys = [object_key(k, i) for k in out.kv_transfer_params["chunk_keys"] for i in range(2)]
        got[layerwise] = (out.kv_transfer_params, dict(zip(keys, store.get(keys))))
        assert engine.connector.publish_layerwise == layerwise
        engine.shutdown()
        store.close()
    (pp, po), (lp, lo) = got[False], got[True]
    assert pp == lp and lp["num_tokens"] == 77
    assert all(po[k] is not None and torch.equal(po[k], lo[k]) for k in po)


def test_a_preempted_request_publishes_what_per_step_publishes(tiny_llama, vocab, stores):
    """Held up: two prompts in chunked prefill on a cache too small for both: one is preempted (its blocks freed and
    reused by the other) after chunks of it went out layer by layer, and recomputes; every object is the per-step
    bytes and a decode node loading either answers as a colocated node."""
    from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
    from pdserve.engine.core.llm_engine import LLMEngine

    prompts = {"a": random_prompt(vocab, 100, seed=41), "b": random_prompt(vocab, 100, seed=42)}
    got = {}
    for layerwise in (False, True):
        store = stores()
        kv = KVTransferConfig(role="prefill", kv_store="embedded", kv_chunk_tokens=ECHUNK,
                              kv_publish_layerwise=layerwise)
        engine = LLMEngine(EngineConfig(model=str(tiny_llama),
                                        cache=CacheConfig(block_size=8, num_gpu_blocks_override=24),
                                        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=128),
                                        kv_transfer=kv),
                           store=store)
        finals = _run_all(engine, [(r, p, SamplingParams(max_tokens=20, **GREEDY)) for r, p in prompts.items()])
        assert engine.scheduler.num_preemptions >= 1
        keys = [object_key(k, i) for p in prompts.values()
                for k in chunk_keys(p, ECHUNK, engine.connector.fingerprint, include_partial=True) for i in range(2)]
        got[layerwise] = ({r: f.kv_transfer_params for r, f in finals.items()}, dict(zip(keys, store.get(keys))), store)
        engine.shutdown()
    (pp, po, _), (lp, lo, lstore) = got[False], got[True]
    assert pp == lp and all(lp[r]["num_tokens"] == 100 for r in prompts)
    assert all(po[k] is not None and torch.equal(po[k], lo[k]) for k in po)
    for rid, prompt in prompts.items():
        params = SamplingParams(max_tokens=6, **GREEDY)
        colocated, _ = run_request(_engine(tiny_llama, "both", None), "c", prompt, params)
        tokens, _ = run_request(_engine(tiny_llama, "decode", lstore), "d", prompt, params, lp[rid])
        assert tokens == colocated, rid
