"""Disaggregated equals colocated for the request parameters the first token carries (issue 10, items 1-6).

A prefill engine and a decode engine share one in-memory store (as in test_disagg_engine.py); the
colocated reference is a ``--role both`` engine without a store. The proxy's request building is
checked on its pure functions; the whole path over HTTP is the parity suite (test_pd_parity.py).
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.kv.kv_transfer import KVTransferParams, TransferMismatchError
from pdserve.engine.runner.sampler import generator_draws
from pdserve.engine.runner.seeded import seeded_uniform
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.text.tokenizer import apply_chat_template, load_tokenizer
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore
from pdserve.proxy.inputs import CHAT, COMPLETIONS, Routing, decode_body, parse_request, prefill_body

PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the warm window."


@pytest.fixture(scope="module")
def engines(tiny_llama):
    store = TieredStore(MemoryTier(256 << 20))

    def engine(role: str) -> LLMEngine:
        kv = KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=32) if role != "both" else \
            KVTransferConfig()
        return LLMEngine(EngineConfig(model=str(tiny_llama), cache=CacheConfig(block_size=8), kv_transfer=kv),
                         store=store if role != "both" else None)

    yield engine("prefill"), engine("decode"), engine("both")
    store.close()


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return load_tokenizer(tiny_llama)


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode(PROMPT)


def _run(engine, rid, prompt, params, transfer=None) -> dict:
    engine.add_request(rid, prompt, params, transfer)
    got = {"tokens": [], "text": "", "logprobs": [], "final": None}
    while engine.has_unfinished():
        for out in engine.step():
            got["tokens"] += out.new_token_ids
            got["text"] += out.new_text
            got["logprobs"] += out.logprobs or []
            if out.finished:
                got["final"] = out
    return got


_ids = iter(range(1 << 30))


def disagg(engines, prompt, params: SamplingParams, prefill_params: SamplingParams | None = None):
    """Prefill (max_tokens=1, the same sampling) then decode, like the proxy does; returns (prefill, decode)."""
    prefill, decode, _ = engines
    first = prefill_params or SamplingParams(**{**_fields(params), "max_tokens": 1, "min_tokens":
                                                min(params.min_tokens, 1)})
    n = next(_ids)
    pf = _run(prefill, f"p{n}", prompt, first, {"do_remote_decode": True})
    return pf, _run(decode, f"d{n}", prompt, params, pf["final"].kv_transfer_params)


def colocated(engines, prompt, params):
    return _run(engines[2], f"c{next(_ids)}", prompt, params)


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in params.__dataclass_fields__}


def test_first_token_logprobs_travel_to_the_decode_node(engines, prompt):
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    pf, got = disagg(engines, prompt, params)
    want = colocated(engines, prompt, params)
    transfer = pf["final"].kv_transfer_params
    assert transfer["first_token_logprob"] == pytest.approx(want["logprobs"][0].logprob, abs=1e-5)
    assert len(transfer["first_token_top_logprobs"]) == 3
    assert got["tokens"] == want["tokens"] and len(got["logprobs"]) == 6
    for g, w in zip(got["logprobs"], want["logprobs"]):
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t for t, _ in g.top_logprobs] == [t for t, _ in w.top_logprobs]


@pytest.mark.parametrize("seed", [0, 7, 1234])
def test_seeded_sampling_continues_the_prefill_nodes_random_stream(engines, prompt, seed):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
    pf, got = disagg(engines, prompt, params)
    assert pf["final"].kv_transfer_params["sampler_draws"] == 1
    assert got["tokens"] == colocated(engines, prompt, params)["tokens"]


def test_prefill_honours_min_tokens_for_the_first_token(engines, prompt, tok):
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    stop_id = colocated(engines, prompt, greedy)["tokens"][0]
    params = SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[stop_id], min_tokens=3)
    _, got = disagg(engines, prompt, params)
    want = colocated(engines, prompt, params)
    assert got["tokens"] == want["tokens"] and stop_id not in got["tokens"][:3]
    body = prefill_body(_parse(tok, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 4, "min_tokens": 3}), None)
    assert body["min_tokens"] == 1                              # the proxy asks the prefill node for that
    assert prefill_body(_parse(tok, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 4}), None)["min_tokens"] == 0


def test_decode_node_never_schedules_a_request_its_first_token_finished(engines, prompt):
    first_text = colocated(engines, prompt, SamplingParams(max_tokens=1, temperature=0.0))["text"]
    assert first_text, "the first greedy token has no text"
    params = SamplingParams(max_tokens=8, temperature=0.0, stop=[first_text[-1]], ignore_eos=True)
    prefill, decode, _ = engines
    pf = _run(prefill, "p-stop", prompt, SamplingParams(**{**_fields(params), "max_tokens": 1}),
              {"do_remote_decode": True})
    assert pf["final"].finish_reason == "stop"
    decode.add_request("d-stop", prompt, params, pf["final"].kv_transfer_params)
    assert not decode.scheduler.has_unfinished()                # finished before any step
    [out] = decode.step()
    assert out.finished and out.finish_reason == "stop" and out.new_text == first_text[:-1]
    assert not decode.has_unfinished()
    assert decode.block_manager.num_free_blocks == decode.runtime.num_blocks


def test_a_seeded_draw_depends_on_the_seed_and_the_draws_before_it_only():
    """The decode node's draw 1 is the prefill node's would-be draw 1: the k-th uniform is a function of
    (seed, k) -- SplitMix64's k-th output, checked against the generator written out step by step."""
    for seed in (0, 5, -3, 2**63 - 1):
        state, sequential = seed & (2**64 - 1), []
        for _ in range(4):
            state = (state + 0x9E3779B97F4A7C15) & (2**64 - 1)
            z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
            sequential.append(((z ^ (z >> 31)) >> 11) * 2.0 ** -53)
        assert [seeded_uniform(seed, k) for k in range(4)] == sequential
    assert generator_draws(SamplingParams(seed=5, temperature=0.7), 3) == 3
    assert generator_draws(SamplingParams(seed=1, temperature=0.0), 3) == 0
    assert generator_draws(SamplingParams(temperature=1.0), 3) == 0


def test_transfer_params_sampling_fields_round_trip_and_are_bounded():
    params = KVTransferParams(do_remote_prefill=True, first_token_id=4, first_token_logprob=-0.25,
                              first_token_top_logprobs=[(4, -0.25), (9, -1.5)], sampler_draws=1)
    assert KVTransferParams.from_json_obj(json.loads(json.dumps(params.to_json_obj()))) == params
    for bad in ({"sampler_draws": -1}, {"first_token_top_logprobs": [[1, -0.1]] * 21}):
        with pytest.raises(TransferMismatchError, match="malformed"):
            KVTransferParams.from_json_obj(bad)


# ---- the proxy's request building ----------------------------------------------------------------

def _parse(tok, endpoint: str, body: dict):
    return asyncio.run(parse_request(endpoint, json.dumps(body).encode(), tok, Routing(4, "proxy:test")))


def test_proxy_renders_chat_with_the_clients_add_generation_prompt(tok):
    messages = [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "Blue, and"}]
    req = _parse(tok, CHAT, {"messages": messages, "add_generation_prompt": False, "max_tokens": 4})
    assert req.prompt_ids == apply_chat_template(tok, messages, add_generation_prompt=False)
    assert len(req.prompt_ids) < len(apply_chat_template(tok, messages))


def test_proxy_serves_a_list_of_prompts(tok):
    req = _parse(tok, COMPLETIONS, {"prompt": ["one two three four five", "six seven"], "max_tokens": 1})
    assert [p.ids for p in req.prompts] == [tok.encode("one two three four five"), tok.encode("six seven")]
    assert not req.prefill_only                                  # one decode call answers both prompts
    assert prefill_body(req, None, 1)["prompt_token_ids"] == tok.encode("six seven")
    ids = _parse(tok, COMPLETIONS, {"prompt": [[5, 6, 7], [8, 9]]})
    assert [p.ids for p in ids.prompts] == [[5, 6, 7], [8, 9]]
    body = decode_body(req, None, [{"a": 1}, None])
    assert body["prompt_token_ids"] == [p.ids for p in req.prompts] and body["kv_transfer_params"] == [{"a": 1}, None]
