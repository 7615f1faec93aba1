"""Prefill -> store -> decode inside one process: output equals colocated and HF; accounting adds up.

Two ``LLMEngine``s (role prefill, role decode) share one in-memory store, so these tests pin the
connector logic without processes; the HTTP/proxy path is tested end to end elsewhere.
"""

from __future__ import annotations

import pytest

from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.kv.kv_transfer import TransferMismatchError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore


def _engine(model_dir, role, store, block_size=8, chunk=32, budget=2048, prefix=True):
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=block_size, enable_prefix_caching=prefix),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                       kv_transfer=KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=chunk))
    return LLMEngine(cfg, store=store)


def _run(engine, rid, prompt, params, transfer=None):
    engine.add_request(rid, prompt, params, transfer)
    tokens, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            if out.finished:
                final = out
    return tokens, final


@pytest.fixture()
def store():
    s = TieredStore(MemoryTier(256 << 20))
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return hf_model(tiny_llama)


@pytest.mark.parametrize("length", [5, 31, 32, 100, 257])
def test_prefill_then_decode_equals_hf(tiny_llama, reference, store, length):
    prompt = random_prompt(reference.config.vocab_size, length, seed=length)
    prefill, decode = _engine(tiny_llama, "prefill", store), _engine(tiny_llama, "decode", store)
    first, pf = _run(prefill, "p", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                     {"do_remote_decode": True})
    params = pf.kv_transfer_params
    assert params["do_remote_prefill"] and params["first_token_id"] == first[0]
    assert params["num_tokens"] == length
    tokens, df = _run(decode, "d", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), params)
    assert tokens == hf_greedy(reference, prompt, 10)
    acc = df.kv_accounting
    assert acc["local_hit_tokens"] + acc["loaded_tokens"] + acc["recomputed_tokens"] == acc["total_tokens"]
    assert acc["total_tokens"] == length + 1                    # prompt + the prefill node's token
    assert acc["loaded_tokens"] == length // 8 * 8              # whole blocks; the first token is recomputed
    assert df.num_cached_tokens == 0                            # a load of what prefill published is not "cached"
    for e in (prefill, decode):
        assert e.block_manager.num_free_blocks == e.runtime.num_blocks
        e.block_manager.check_integrity()


def test_decode_recomputes_when_store_lost_the_kv(tiny_llama, reference, store):
    prompt = random_prompt(reference.config.vocab_size, 70, seed=3)
    prefill, decode = _engine(tiny_llama, "prefill", store), _engine(tiny_llama, "decode", store)
    _, pf = _run(prefill, "p", prompt, SamplingParams(max_tokens=1, temperature=0.0), {"do_remote_decode": True})
    store.delete([k for k in store.l1.keys_lru_order() if k.startswith(pf.kv_transfer_params["chunk_keys"][1])])
    tokens, df = _run(decode, "d", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                      pf.kv_transfer_params)
    assert tokens == hf_greedy(reference, prompt, 8)
    assert df.kv_accounting["store_hit_tokens"] == 32           # only chunk 0 is whole in the store
    assert df.kv_accounting["loaded_tokens"] == 32


def test_both_role_uses_store_as_second_level_cache(tiny_llama, reference, store):
    prompt = random_prompt(reference.config.vocab_size, 90, seed=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    writer = _engine(tiny_llama, "both", store)
    cold, c = _run(writer, "a", prompt, params)
    reader = _engine(tiny_llama, "both", store)                 # empty local cache, warm store
    warm, w = _run(reader, "b", prompt, params)
    assert warm == cold == hf_greedy(reference, prompt, 6)
    assert c.kv_accounting["store_hit_tokens"] == 0
    assert w.kv_accounting["store_hit_tokens"] == 90 and w.kv_accounting["loaded_tokens"] == 88
    assert w.num_cached_tokens == 88                             # reused instead of computed


def test_mismatched_chunk_size_is_refused(tiny_llama, reference, store):
    prompt = random_prompt(reference.config.vocab_size, 40, seed=5)
    prefill, decode = _engine(tiny_llama, "prefill", store, chunk=32), _engine(tiny_llama, "decode", store, chunk=64)
    _, pf = _run(prefill, "p", prompt, SamplingParams(max_tokens=1, temperature=0.0), {"do_remote_decode": True})
    with pytest.raises(TransferMismatchError, match="chunk_tokens=32.*chunk_tokens=64"):
        decode.add_request("d", prompt, SamplingParams(max_tokens=4), pf.kv_transfer_params)


def test_chunked_prefill_publishes_and_decode_matches(tiny_llama, reference, store):
    prompt = random_prompt(reference.config.vocab_size, 150, seed=6)
    prefill = _engine(tiny_llama, "prefill", store, budget=40)  # prompt spans 4 steps
    decode = _engine(tiny_llama, "decode", store)
    _, pf = _run(prefill, "p", prompt, SamplingParams(max_tokens=1, temperature=0.0), {"do_remote_decode": True})
    assert len(pf.kv_transfer_params["chunk_keys"]) == 5
    tokens, _ = _run(decode, "d", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                     pf.kv_transfer_params)
    assert tokens == hf_greedy(reference, prompt, 8)


def test_a_decode_request_ended_by_the_prefill_token_reports_nothing_computed(tiny_llama, store, caplog):
    """max_tokens=1 through P/D (a streamed request goes to the decode node anyway): the decode node emits the
    prefill node's token and finishes without scheduling -- it must not report the prompt as recomputed
    (it used to: total 20, recomputed 20), nor count it in its totals (total included: they must still add up)."""
    prompt = list(range(3, 23))
    prefill, decode = _engine(tiny_llama, "prefill", store), _engine(tiny_llama, "decode", store)
    first, pf = _run(prefill, "p", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                     {"do_remote_decode": True})
    with caplog.at_level("INFO", logger="pdserve.kv"):
        tokens, df = _run(decode, "d", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                          pf.kv_transfer_params)
    assert tokens == first and df.finish_reason == "length"
    assert df.kv_accounting == {"total_tokens": 0, "local_hit_tokens": 0, "store_hit_tokens": 0, "need_to_load": 0,
                                "loaded_tokens": 0, "recomputed_tokens": 0}
    assert set(decode.outputs.totals.values()) == {0}          # the node's totals: nothing (they add up)
    assert "req=d not run" in caplog.text
    assert decode.block_manager.num_free_blocks == decode.runtime.num_blocks
