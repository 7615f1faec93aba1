"""End-to-end KV integrity (issue 9): sealed objects, prefill digests, the model fingerprint.

A checksum alone did not catch a get answered with another key's whole object (its checksum is
valid too). Every object the publisher stores is sealed with the hash of its key; the decode loader
checks the seal and the prefill node's chunk digest before a block is scattered. Each case here
would have produced wrong tokens before the seal / digest / fingerprint existed (the docstrings say
which mutation of the code each one catches).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading

import pytest
import torch

from engine_run import run_request
from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.auth import process_key
from pdserve.kvstore.keys import object_key
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.seal import SEAL_BYTES, SealError, chunk_digest, seal, unseal
from pdserve.kvstore.tiered import TieredStore

GREEDY = dict(temperature=0.0, ignore_eos=True)
KEY = process_key().seal_key          # what engines in this process seal with (an embedded store, no token)


def _engine(model_dir, role, store, chunk=32, publish_layerwise=True):
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=2048),
                       kv_transfer=KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=chunk,
                                                    kv_publish_layerwise=publish_layerwise))
    return LLMEngine(cfg, store=store)


_run = run_request


@pytest.fixture()
def store():
    s = TieredStore(MemoryTier(256 << 20))
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return hf_model(tiny_llama)


# -- the seal -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_seal_round_trip_is_a_bit_identical_view(dtype):
    t = torch.randn(2, 5, 3, 4).to(dtype)
    obj, checksum = seal("k:0", t, KEY)
    assert obj.dtype == torch.uint8 and obj.numel() == SEAL_BYTES + t.numel() * t.element_size()
    view, got = unseal("k:0", obj, KEY)
    assert got == checksum and view.dtype == dtype and view.shape == t.shape
    assert torch.equal(view.view(torch.uint8), t.view(torch.uint8))


def test_seal_names_its_key_and_covers_every_byte():
    obj, _ = seal("a:0", torch.randn(2, 4, 2, 8), KEY)
    with pytest.raises(SealError, match="another key"):
        unseal("b:0", obj, KEY)                                   # a valid object, answered for another key
    for pos in (0, 10, 60, SEAL_BYTES, obj.numel() - 1):
        bad = obj.clone()
        bad[pos] ^= 0x40
        with pytest.raises(SealError):
            unseal("a:0", bad, KEY)
    with pytest.raises(SealError, match="not a sealed object"):
        unseal("a:0", torch.randn(2, 4), KEY)


def test_chunk_digest_depends_on_order_and_content():
    assert chunk_digest([b"1", b"2"]) != chunk_digest([b"2", b"1"]) != chunk_digest([b"1", b"3"])
    assert chunk_digest([b"1", b"2"]) == chunk_digest([b"1", b"2"])


# -- the loader refuses what the seal or the digest says is not this chunk --------------------

def _prefill(tiny_llama, store, prompt, publish_layerwise=True):
    prefill = _engine(tiny_llama, "prefill", store, publish_layerwise=publish_layerwise)
    _, out = _run(prefill, "p", prompt, SamplingParams(max_tokens=1, **GREEDY), {"do_remote_decode": True})
    return out.kv_transfer_params


def test_object_of_another_key_is_refused_deleted_and_recomputed(tiny_llama, reference, store):
    """Mutation caught: loader scatters ``obj`` without ``unseal`` -> wrong tokens (the daemon race's symptom)."""
    a = random_prompt(reference.config.vocab_size, 70, seed=11)
    b = random_prompt(reference.config.vocab_size, 70, seed=12)
    pa, pb = _prefill(tiny_llama, store, a), _prefill(tiny_llama, store, b)
    victim = object_key(pa["chunk_keys"][1], 1)
    store.put([(victim, store.get([object_key(pb["chunk_keys"][1], 1)])[0])])   # b's valid object under a's key
    decode = _engine(tiny_llama, "decode", store)
    tokens, out = _run(decode, "d", a, SamplingParams(max_tokens=8, **GREEDY), pa)
    assert tokens == hf_greedy(reference, a, 8)
    assert decode.connector.loader.integrity_failures == 1
    assert out.kv_accounting["loaded_tokens"] == 32                   # chunk 0 only; chunk 1 recomputed
    assert store.get([victim]) == [None]                              # the bad object is gone


def test_valid_object_that_is_not_what_prefill_published_is_refused(tiny_llama, reference, store):
    """Mutation caught: loader ignores ``chunk_digests`` -> a stale writer's KV is used (wrong tokens)."""
    prompt = random_prompt(reference.config.vocab_size, 70, seed=13)
    params = _prefill(tiny_llama, store, prompt)
    assert len(params["chunk_digests"]) == 3 and all(params["chunk_digests"])
    key = object_key(params["chunk_keys"][0], 0)
    view, _ = unseal(key, store.get([key])[0], KEY)
    store.put([(key, seal(key, view + 1.0, KEY)[0])])                 # correctly sealed, different KV
    decode = _engine(tiny_llama, "decode", store)
    tokens, out = _run(decode, "d", prompt, SamplingParams(max_tokens=8, **GREEDY), params)
    assert tokens == hf_greedy(reference, prompt, 8)
    assert decode.connector.loader.digest_mismatches == 1 and out.kv_accounting["loaded_tokens"] == 0


def test_the_last_chunks_digest_is_checked_too(tiny_llama, reference, store):
    """Mutation caught (issue 43): ``index < len(job.digests) - 1`` in the loader -- the last chunk's digest is never
    checked, and a validly sealed object holding other KV there is loaded: 64 prompt tokens in two 32-token chunks,
    the last one replaced in every layer."""
    prompt = random_prompt(reference.config.vocab_size, 64, seed=14)
    params = _prefill(tiny_llama, store, prompt)
    assert len(params["chunk_keys"]) == len(params["chunk_digests"]) == 2
    for layer in range(reference.config.num_hidden_layers):
        key = object_key(params["chunk_keys"][1], layer)
        view, _ = unseal(key, store.get([key])[0], KEY)
        store.put([(key, seal(key, view + 1.0, KEY)[0])])             # correctly sealed, different KV
    decode = _engine(tiny_llama, "decode", store)
    tokens, out = _run(decode, "d", prompt, SamplingParams(max_tokens=8, **GREEDY), params)
    assert tokens == hf_greedy(reference, prompt, 8)
    assert decode.connector.loader.digest_mismatches == 1
    assert out.kv_accounting["loaded_tokens"] == 32                   # chunk 0 only; the last chunk recomputed


def test_unpublished_chunks_are_not_advertised(tiny_llama, reference, store, monkeypatch):
    """Mutation caught: ``num_tokens`` counted chunks handed to the publisher, not those the store took.
    Per-step publishing: one put per chunk, so refusing the second put refuses chunk 1 alone (a layerwise publisher
    may put layers of two chunks together when the store lags: ``test_publish_layerwise.py`` covers that path)."""
    prompt = random_prompt(reference.config.vocab_size, 70, seed=14)
    real_adopt, calls = store.adopt, []

    def flaky_adopt(items):
        calls.append(items[0][0])
        if len(calls) == 2:
            raise ConnectionError("injected: store refused chunk 1")
        real_adopt(items)

    monkeypatch.setattr(store, "adopt", flaky_adopt)
    params = _prefill(tiny_llama, store, prompt, publish_layerwise=False)
    assert params["num_tokens"] == 32 and len(params["chunk_digests"]) == 1
    monkeypatch.setattr(store, "adopt", real_adopt)
    tokens, _ = _run(_engine(tiny_llama, "decode", store), "d", prompt, SamplingParams(max_tokens=6, **GREEDY), params)
    assert tokens == hf_greedy(reference, prompt, 6)


def test_aborted_requests_leave_no_publisher_state(tiny_llama, reference, store):
    """Mutation caught: abort -> ``close_request`` kept every aborted id in the publisher's done-set."""
    decode, prefill = _engine(tiny_llama, "decode", store), _engine(tiny_llama, "prefill", store)
    prompt = random_prompt(reference.config.vocab_size, 40, seed=15)
    for engine in (decode, prefill):
        for i in range(20):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4, **GREEDY),
                               {"do_remote_decode": True} if engine is prefill else None)
            engine.step()
            engine.abort_request(f"r{i}")
        while engine.has_unfinished():
            engine.step()
        engine.connector.shutdown()
        pub = engine.connector.publisher
        assert pub._done == {} and pub._pending == {} and engine.connector._reqs == {}


# -- the fingerprint covers the model config ----------------------------------------------------

def test_same_weights_other_rope_do_not_share_keys(tiny_llama, reference, store, tmp_path):
    """Mutation caught: fingerprint without ``config_identity`` -> model B loads model A's KV.

    B has byte-identical weights and another ``rope_theta``; its output with A's chunks in the shared
    store must equal its output alone.
    """
    other = tmp_path / "rope"
    shutil.copytree(tiny_llama, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"] = 70000.0    # what transformers 4.x / 5.x read
    (other / "config.json").write_text(json.dumps(cfg))
    prompt = random_prompt(reference.config.vocab_size, 70, seed=16)
    greedy = SamplingParams(max_tokens=8, **GREEDY)
    alone, _ = _run(_engine(other, "both", TieredStore(MemoryTier(64 << 20))), "b0", prompt, greedy)
    a = _engine(tiny_llama, "both", store)
    _run(a, "a", prompt, greedy)
    b = _engine(other, "both", store)
    assert b.connector.fingerprint != a.connector.fingerprint
    tokens, out = _run(b, "b", prompt, greedy)
    assert tokens == alone
    assert out.kv_accounting["store_hit_tokens"] == 0


def test_an_id_whose_aborted_load_is_still_running_is_refused_not_fatal(tiny_llama, reference, store):
    """Before: re-adding the id of a request aborted during its KV load made the next ``step()`` raise
    ``another request with id ... already holds blocks`` (fatal for a node's engine thread)."""
    prompt = random_prompt(reference.config.vocab_size, 70, seed=17)
    params = _prefill(tiny_llama, store, prompt)
    gate, entered, real_borrow = threading.Event(), threading.Event(), store.borrow

    @contextlib.contextmanager
    def slow_borrow(keys):
        entered.set()
        gate.wait(30)
        with real_borrow(keys) as objs:
            yield objs

    store.borrow = slow_borrow
    decode = _engine(tiny_llama, "decode", store)
    greedy = SamplingParams(max_tokens=4, **GREEDY)
    decode.add_request("r1", prompt, greedy, params)
    decode.step()
    assert entered.wait(10)
    decode.abort_request("r1")
    with pytest.raises(ValueError, match="still finishing"):
        decode.add_request("r1", prompt, greedy, params)
    gate.set()
    while decode.has_unfinished() or decode.scheduler.loading:
        decode.step()
    store.borrow = real_borrow
    tokens, _ = _run(decode, "r1", prompt, greedy, params)
    assert tokens == hf_greedy(reference, prompt, 4)
    assert decode.block_manager.num_free_blocks == decode.runtime.num_blocks
