"""Store lookups off the engine thread (``decode/lookups.py``, review 40): a request whose lookup has not answered
waits in the queue while the running requests keep stepping, and an abort meanwhile leaves nothing behind.

A real embedded store and the tiny llama on a decode node; the store's ``lookup`` is held on an event -- what a
daemon that does not answer does to the lookup thread, in process (tests/test_review40_hung_store_stall.py has the
real daemon, SIGSTOPped). Each test failed before the lookup left the engine thread: ``add_request`` + ``step``
blocked in the held lookup.
"""

from __future__ import annotations

import threading

import pytest

from engine_run import run_request
from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.request import RequestStatus
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore

GREEDY = dict(temperature=0.0, ignore_eos=True)
CHUNK = 16


def _engine(model_dir, role, store):
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       kv_transfer=KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=CHUNK))
    return LLMEngine(cfg, store=store)


@pytest.fixture()
def store():
    s = TieredStore(MemoryTier(256 << 20))
    yield s
    s.close()


@pytest.fixture(scope="module")
def ref(tiny_llama):
    return hf_model(tiny_llama)


def _publish(model_dir, store, prompt) -> None:
    """A prefill node computes ``prompt`` and publishes its KV (what a store_hit / decode_local request finds)."""
    prefill = _engine(model_dir, "prefill", store)
    run_request(prefill, "p", prompt, SamplingParams(max_tokens=1, **GREEDY), {"do_remote_decode": True})
    prefill.shutdown()


def _hold_lookups(store) -> tuple[threading.Event, threading.Event]:
    """-> (release, entered): the store's lookups wait for ``release``; ``entered`` is set once one is waiting."""
    release, entered, real = threading.Event(), threading.Event(), store.lookup

    def held(chunk_keys, num_layers):
        entered.set()
        assert release.wait(30), "the test never released the held lookup"
        return real(chunk_keys, num_layers)

    store.lookup = held
    return release, entered


def _tokens(outs, rid) -> list[int]:
    return [t for o in outs if o.request_id == rid for t in o.new_token_ids]


def _finish(engine, outs: list) -> list:
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_a_pending_lookup_does_not_hold_up_a_running_stream(tiny_llama, store, ref):
    """b's lookup is held: every step still gives a its next token, b waits (no blocks) at the head of the queue;
    once the store answers, b loads the published chunks and both generate what HF generates."""
    a_prompt = random_prompt(ref.config.vocab_size, 21, seed=61)
    b_prompt = random_prompt(ref.config.vocab_size, 53, seed=62)
    _publish(tiny_llama, store, b_prompt)
    engine = _engine(tiny_llama, "decode", store)
    engine.add_request("a", a_prompt, SamplingParams(max_tokens=12, **GREEDY))
    outs = engine.step()
    assert _tokens(outs, "a"), "a ran its prefill"
    release, entered = _hold_lookups(store)
    engine.add_request("b", b_prompt, SamplingParams(max_tokens=4, **GREEDY))
    assert entered.wait(10), "b's lookup started"
    for _ in range(5):
        step = engine.step()
        assert len(_tokens(step, "a")) == 1 and not _tokens(step, "b")
        outs += step
    b = engine.scheduler.waiting[0]
    assert b.request_id == "b" and b.status == RequestStatus.WAITING and not b.block_ids
    release.set()
    outs = _finish(engine, outs)
    assert _tokens(outs, "a") == hf_greedy(ref, a_prompt, 12)
    assert _tokens(outs, "b") == hf_greedy(ref, b_prompt, 4)
    final = next(o for o in outs if o.request_id == "b" and o.finished)
    assert final.kv_accounting["store_hit_tokens"] == 53 and final.kv_accounting["loaded_tokens"] == 48   # block-aligned, never the last token
    assert len(engine.connector.loader.lookups) == 0 and not engine.connector._reqs
    engine.shutdown()


def test_an_abort_during_a_pending_lookup_leaves_nothing_behind(tiny_llama, store, ref):
    """b is aborted while its lookup is held: the connector and the lookup thread keep nothing of it, the engine has
    nothing left to run. The same id added again (another prompt, not in the store) gets its own answer when the
    store answers, never the aborted request's (a store hit of 48 tokens for keys it does not have)."""
    published = random_prompt(ref.config.vocab_size, 53, seed=63)
    other = random_prompt(ref.config.vocab_size, 29, seed=64)
    _publish(tiny_llama, store, published)
    engine = _engine(tiny_llama, "decode", store)
    release, entered = _hold_lookups(store)
    engine.add_request("b", published, SamplingParams(max_tokens=4, **GREEDY))
    assert entered.wait(10), "b's lookup started"
    assert engine.step() == [] and engine.scheduler.waiting[0].request_id == "b"
    engine.abort_request("b")
    lookups = engine.connector.loader.lookups
    assert len(lookups) == 0 and not engine.connector._reqs and not engine.has_unfinished()
    engine.add_request("b", other, SamplingParams(max_tokens=4, **GREEDY))
    release.set()
    outs = _finish(engine, [])
    assert _tokens(outs, "b") == hf_greedy(ref, other, 4)
    final = next(o for o in outs if o.request_id == "b" and o.finished)
    assert final.kv_accounting["store_hit_tokens"] == 0 and final.kv_accounting["loaded_tokens"] == 0
    assert len(lookups) == 0 and not lookups._answers and not engine.connector._reqs
    engine.shutdown()
