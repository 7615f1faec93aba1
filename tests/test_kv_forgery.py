"""Forged KV changes nobody's answer (issue 35, findings 1 and 2): keyed seals, checked on every load.

An attacker without the cluster key computes the victim's object keys (prompt + the public model fingerprint)
and writes junk KV under them, sealed the way pdserve sealed before (xxh3, public) or MAC'd with a key of its
own -- through Redis, a disk directory, or a daemon that has no token. Before keyed seals both nodes loaded
the v1 forgeries (and kept them in their prefix caches): the victim got other tokens with status 200. Now
every object is checked against the cluster's seal key: a counted miss, a recompute, the colocated answer,
and the prefill node publishes the real KV over the forgery.
"""

from __future__ import annotations

import pytest
import redis

from engine_run import run_request
from forgery import forge_keyed, forge_v1, plant
from hf_reference import hf_greedy, hf_model, random_prompt
from kvstore_fixtures import *  # noqa: F401,F403 - fixtures
from kvstore_fixtures import DaemonProcess, unique_prefix
from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore import codec
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.redis_tier import RedisTier
from pdserve.kvstore.tiered import TieredStore

TOKEN = "forgery-test-cluster-token-0123456789"
CHUNK = 32
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
RECIPES = {"v1 public seal": forge_v1, "keyed with another key": forge_keyed}


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return hf_model(tiny_llama)


def _engine(model_dir, role, store):
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=2048),
                       kv_transfer=KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=CHUNK,
                                                    kv_auth_token=TOKEN))
    return LLMEngine(cfg, store=store)


def _plant(engine, prompt, write, recipe):
    c = engine.connector
    return plant(write, prompt, CHUNK, c.fingerprint, engine.model_config.num_layers, c.loader.expect_shape, recipe)


def _victim(tiny_llama, reference, prompt, prefill_store, decode_store):
    """The victim's P/D request: the prefill node first (it sees the forgery as a store hit), then decode."""
    prefill, decode = _engine(tiny_llama, "prefill", prefill_store), _engine(tiny_llama, "decode", decode_store)
    try:
        first, out = run_request(prefill, "p", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                 {"do_remote_decode": True})
        tokens, dout = run_request(decode, "d", prompt, GREEDY, out.kv_transfer_params)
        assert first == hf_greedy(reference, prompt, 1) and tokens == hf_greedy(reference, prompt, 8)
        again, _ = run_request(decode, "d2", prompt, GREEDY, out.kv_transfer_params)   # its prefix cache is clean
        assert again == tokens
        return prefill.connector.loader, out.kv_accounting, dout.kv_accounting
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_kv_forged_in_redis_is_a_counted_miss(tiny_llama, reference, redis_server, recipe):
    prefix = unique_prefix() + ":"
    raw = redis.Redis(port=redis_server.port)

    def stores():
        return TieredStore(MemoryTier(64 << 20), [RedisTier(redis_server.url, prefix)])

    prompt = random_prompt(reference.config.vocab_size, 70, seed=21)
    probe = _engine(tiny_llama, "both", TieredStore(MemoryTier(1 << 20)))
    planted = _plant(probe, prompt, lambda k, obj: raw.set(prefix + k, codec.encode(obj, "none", k)), RECIPES[recipe])
    probe.shutdown()
    assert all(raw.exists(prefix + k) for k in planted)
    prefill_store, decode_store = stores(), stores()
    try:
        loader, pacc, dacc = _victim(tiny_llama, reference, prompt, prefill_store, decode_store)
    finally:
        prefill_store.close()
        decode_store.close()
    assert loader.integrity_failures == 1 and pacc["store_hit_tokens"] == 70 and pacc["loaded_tokens"] == 0
    assert dacc["loaded_tokens"] > 0                     # the prefill node published the real KV over the forgery


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_kv_forged_on_disk_is_a_counted_miss(tiny_llama, reference, tmp_path, recipe):
    prompt = random_prompt(reference.config.vocab_size, 70, seed=22)
    planter = DiskTier(tmp_path / "kv", 64 << 20)
    probe = _engine(tiny_llama, "both", TieredStore(MemoryTier(1 << 20)))
    _plant(probe, prompt, lambda k, obj: planter._write([(k, codec.encode(obj, "none", k))]), RECIPES[recipe])
    probe.shutdown()
    store = TieredStore(MemoryTier(64 << 20), [DiskTier(tmp_path / "kv", 64 << 20)])   # finds the files at start
    try:
        loader, pacc, _ = _victim(tiny_llama, reference, prompt, store, store)
    finally:
        store.close()
    assert loader.integrity_failures == 1 and pacc["store_hit_tokens"] == 70 and pacc["loaded_tokens"] == 0


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_kv_forged_through_a_daemon_without_a_token_is_a_counted_miss(tiny_llama, reference, recipe):
    """Even a daemon anyone can write to cannot change an answer: the nodes hold the seal key, the daemon does not
    (their client has no token here: a client with one would refuse a daemon that cannot prove it)."""
    daemon = DaemonProcess("--kv-cpu-bytes", str(64 << 20), "--log-level", "ERROR")
    prompt = random_prompt(reference.config.vocab_size, 70, seed=23)
    try:
        with DaemonClient(daemon.url, timeout_s=20) as attacker, \
                DaemonClient(daemon.url, timeout_s=20) as node_client:
            probe = _engine(tiny_llama, "both", TieredStore(MemoryTier(1 << 20)))
            _plant(probe, prompt, lambda k, obj: attacker.put([(k, obj)]), RECIPES[recipe])
            probe.shutdown()
            loader, pacc, dacc = _victim(tiny_llama, reference, prompt, node_client, node_client)
    finally:
        daemon.stop()
    assert loader.integrity_failures == 1 and pacc["loaded_tokens"] == 0 and dacc["loaded_tokens"] > 0
