"""Structured outputs in the engine on tiny random models (issue 37): gibberish weights, valid output by construction.

- Every kind (a JSON schema with a nested object, an enum, an array and required fields; json_object; regex; choice;
  an EBNF grammar) gives output that parses and matches, finishing with "stop" once the constraint is complete,
  greedy or seeded, for a byte-level BPE and a Metaspace tokenizer.
- Greedy is the argmax over the allowed tokens: the same ids as HF transformers' logits masked by an xgrammar
  matcher step by step.
- A request whose grammar is compiling waits in WAITING_FOR_GRAMMAR without holding anyone back (its compile held
  by the compiler's test hook); aborted there, it leaves nothing behind.
- A constraint that fails to compile in the core fails its request only, with the reason; the engine goes on.
- ``min_tokens`` bans eos while the constraint may go on; once it allows nothing but its end, it ends there.
- Prefill engine -> store -> decode engine equals one colocated engine, greedy and seeded; a first token the
  constraint refuses fails the decode request.
"""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

from hf_reference import hf_model
from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.request import RequestStatus
from pdserve.engine.structured.spec import StructuredOutputs
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore
from polling import wait_until

xgr = pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                     "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "color", "tags", "address"],
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ("yes", "no", "maybe not")
EBNF = 'root ::= "(" expr ")"\nexpr ::= num (("+" | "*") num){0,3}\nnum ::= [1-9] [0-9]?'
PROMPT = "Describe a person as JSON:"
# any JSON object: keys and values are unbounded strings, where a random model may ramble past max_tokens; with
# this prompt both tiny models close their object (greedy and seeded)
JSON_OBJECT_PROMPT = "JSON:"


def check_schema(text: str) -> None:
    """``text`` is a JSON document valid against SCHEMA (jsonschema_rs when installed, else by hand)."""
    doc = json.loads(text)
    try:
        import jsonschema_rs
    except ImportError:
        jsonschema_rs = None
    if jsonschema_rs is not None:
        jsonschema_rs.validate(SCHEMA, doc)
        return
    assert set(SCHEMA["required"]) <= set(doc) and doc["color"] in ("red", "green", "blue")
    assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 3 and {"city", "zip"} <= set(doc["address"])


CHECKS = {
    "json": check_schema,
    "json_object": lambda text: isinstance(json.loads(text), dict) or pytest.fail(text),
    "regex": lambda text: re.fullmatch(REGEX, text) or pytest.fail(text),
    "choice": lambda text: text in CHOICES or pytest.fail(text),
    "grammar": lambda text: re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?){0,3}\)", text) or pytest.fail(text),
}
SPECS = {"json": StructuredOutputs(json=json.dumps(SCHEMA)), "json_object": StructuredOutputs(json_object=True),
         "regex": StructuredOutputs(regex=REGEX), "choice": StructuredOutputs(choice=CHOICES),
         "grammar": StructuredOutputs(grammar=EBNF)}


def _engine(model_dir, role="both", store=None) -> LLMEngine:
    kv = KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=8) if store is not None else \
        KVTransferConfig()
    return LLMEngine(EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8), kv_transfer=kv),
                     store=store)


def run(engine: LLMEngine, requests: dict, transfers: dict | None = None) -> dict:
    """{id: (prompt ids, params)} -> {id: final state dict: token ids, text, finish reason, error, transfer}."""
    results = {rid: {"ids": [], "text": ""} for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params, (transfers or {}).get(rid))
    while engine.has_unfinished():
        for out in engine.step():
            r = results[out.request_id]
            r["ids"] += out.new_token_ids
            r["text"] += out.new_text
            if out.finished:
                r.update(finish=out.finish_reason, error=out.error, transfer=out.kv_transfer_params)
    return results


@pytest.fixture(scope="module", params=["bpe", "metaspace"])
def engine(request, tiny_llama, tiny_llama_metaspace):
    e = _engine(tiny_llama if request.param == "bpe" else tiny_llama_metaspace)
    yield e
    e.shutdown()


def _prompt(engine, kind: str = "json") -> list[int]:
    return engine.tokenizer.encode(JSON_OBJECT_PROMPT if kind == "json_object" else PROMPT)


@pytest.mark.parametrize("kind", list(SPECS))
def test_every_kind_gives_valid_output_greedy_and_seeded(engine, kind):
    greedy = SamplingParams(max_tokens=200, temperature=0.0, structured=SPECS[kind])
    seeded = SamplingParams(max_tokens=200, temperature=1.0, seed=1, structured=SPECS[kind])
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = _prompt(engine, kind)
    out = run(engine, {"greedy": (prompt, greedy), "seeded": (prompt, seeded), "plain": (prompt, plain)})
    for rid in ("greedy", "seeded"):
        assert out[rid]["finish"] == "stop" and out[rid]["error"] is None, out[rid]
        CHECKS[kind](out[rid]["text"])
    assert len(out["plain"]["ids"]) == 12                  # a request without a constraint in the same batch


@torch.inference_mode()
def test_greedy_is_the_argmax_over_allowed_tokens(tiny_llama):
    """HF logits at each position, masked by a matcher of the same grammar, argmax: the engine's ids."""
    engine = _engine(tiny_llama)
    try:
        prompt = _prompt(engine)
        params = SamplingParams(max_tokens=120, temperature=0.0, structured=SPECS["json"])
        got = run(engine, {"r": (prompt, params)})["r"]["ids"]
        compiled = engine.structured.compiler.submit(SPECS["json"]).result(timeout=60)
    finally:
        engine.shutdown()
    model, matcher = hf_model(tiny_llama), xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, model.config.vocab_size)
    ids, expected = list(prompt), []
    while not matcher.is_terminated() and len(expected) < 120:
        logits = model(torch.tensor([ids])).logits[0, -1:].float()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        assert matcher.accept_token(token)
        expected.append(token)
        ids.append(token)
    assert got == expected


def test_a_compiling_request_holds_nobody_back_and_aborts_cleanly(tiny_llama):
    engine = _engine(tiny_llama)
    gate = threading.Event()
    engine.structured.compiler.before_compile = lambda spec: gate.wait(120)
    try:
        prompt = _prompt(engine)
        engine.add_request("held", prompt, SamplingParams(max_tokens=60, temperature=0.0, structured=SPECS["choice"]))
        engine.add_request("aborted", prompt, SamplingParams(max_tokens=60, structured=SPECS["regex"]))
        engine.add_request("plain", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        done = []
        while not done:
            done = [o for o in engine.step() if o.finished]
        assert [(o.request_id, o.finish_reason) for o in done] == [("plain", "length")]
        assert engine.scheduler.compiling.keys() == {"held", "aborted"}
        assert engine.scheduler.compiling["held"].status == RequestStatus.WAITING_FOR_GRAMMAR
        engine.abort_request("aborted")
        engine.scheduler.check_integrity()
        gate.set()
        text, finish = "", None
        while engine.has_unfinished():                     # the held one goes on once compiled
            for out in engine.step():
                assert out.request_id == "held"
                text += out.new_text
                finish = out.finish_reason
        assert finish == "stop" and text in CHOICES
        assert not engine.structured._compiles and not engine.structured._matchers   # nothing left behind
    finally:
        gate.set()
        engine.shutdown()


def test_a_failed_compile_fails_its_request_only(tiny_llama):
    engine = _engine(tiny_llama)
    try:
        prompt = _prompt(engine)
        with pytest.raises(ValueError, match="not valid JSON"):          # refused at add: nothing kept
            engine.add_request("x", prompt, SamplingParams(structured=StructuredOutputs(json='{"type": ')))
        assert not engine.has_unfinished()
        out = run(engine, {"bad": (prompt, SamplingParams(max_tokens=20, structured=StructuredOutputs(regex="[a-"))),
                           "good": (prompt, SamplingParams(max_tokens=20, temperature=0.0,
                                                           structured=SPECS["choice"]))})
        assert out["bad"]["finish"] == "abort" and "invalid regex" in out["bad"]["error"], out["bad"]
        assert out["good"]["finish"] == "stop" and out["good"]["text"] in CHOICES
        again = run(engine, {"next": (prompt, SamplingParams(max_tokens=20, temperature=0.0,
                                                             structured=SPECS["regex"]))})
        assert re.fullmatch(REGEX, again["next"]["text"])
        engine.scheduler.check_integrity()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("seed", [None, 5])
def test_a_complete_constraint_wins_over_min_tokens(engine, seed):
    """min_tokens bans eos, but the constraint allows nothing else: the answer ends there, complete; while the
    constraint may go on, the ban holds ("a+" goes on to min_tokens)."""
    temperature = 0.0 if seed is None else 1.0
    params = {"done": SamplingParams(max_tokens=20, temperature=temperature, seed=seed, min_tokens=10,
                                     structured=StructuredOutputs(choice=("a",))),
              "more": SamplingParams(max_tokens=20, temperature=temperature, seed=seed, min_tokens=6,
                                     structured=StructuredOutputs(regex="a+"))}
    out = run(engine, {rid: (_prompt(engine), p) for rid, p in params.items()})
    assert (out["done"]["text"], out["done"]["finish"], out["done"]["error"]) == ("a", "stop", None)
    assert out["more"]["text"].startswith("a" * 6) and set(out["more"]["text"]) == {"a"}, out["more"]


@pytest.fixture()
def pd(tiny_llama):
    store = TieredStore(MemoryTier(256 << 20))
    prefill, decode = _engine(tiny_llama, "prefill", store), _engine(tiny_llama, "decode", store)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()
    store.close()


@pytest.mark.parametrize("kind", ["json", "grammar"])
@pytest.mark.parametrize("seed", [None, 11])
def test_prefill_then_decode_equals_colocated(tiny_llama, pd, kind, seed):
    prefill, decode = pd
    params = SamplingParams(max_tokens=150, temperature=0.0 if seed is None else 1.0, seed=seed,
                            structured=SPECS[kind])
    colocated = _engine(tiny_llama)
    try:
        prompt = _prompt(colocated)
        want = run(colocated, {"c": (prompt, params)})["c"]
    finally:
        colocated.shutdown()
    from dataclasses import replace

    first = run(prefill, {"p": (prompt, replace(params, max_tokens=1))}, {"p": {"do_remote_decode": True}})["p"]
    got = run(decode, {"d": (prompt, params)}, {"d": first["transfer"]})["d"]
    assert got["ids"] == want["ids"] and got["finish"] == want["finish"] == "stop"
    CHECKS[kind](got["text"])


def test_a_first_token_the_constraint_refuses_fails_the_decode_request(tiny_llama, pd):
    prefill, decode = pd
    prompt = decode.tokenizer.encode(PROMPT)
    first = run(prefill, {"p": (prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))},
                {"p": {"do_remote_decode": True}})["p"]
    refused = first["transfer"]["first_token_id"]
    assert decode.tokenizer.decode([refused]) not in ("y", "n", "m")
    params = SamplingParams(max_tokens=10, temperature=0.0, structured=StructuredOutputs(choice=("yes", "no", "m")))
    got = run(decode, {"d": (prompt, params)}, {"d": first["transfer"]})["d"]
    assert got["finish"] == "abort" and f"first output token {refused}" in got["error"], got
    wait_until(lambda: not decode.has_unfinished(), 30, "the decode engine is idle")
