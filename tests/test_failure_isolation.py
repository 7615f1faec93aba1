"""One request's failure fails that request only (issue 11: failure isolation in the engine).

Faults are injected where real ones happen -- the sampler (a generator that cannot be seeded, a token
id outside the vocabulary), output processing (detokenizer, stop strings), the batched forward pass --
and each test checks: the culprit gets an error, its blocks are freed, every other request in the
same batch gets exactly its colocated answer, and the engine keeps serving.
Mutation caught by each: remove the matching ``try`` in ``ModelRunner.sample_requests``,
``OutputAssembler._emit_safely`` or ``LLMEngine.step`` -> the exception escapes ``step()`` (the
node's engine thread died on it before).
"""

from __future__ import annotations

import asyncio

import pytest

import pdserve.engine.runner.model_runner as model_runner
from hf_reference import random_prompt
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.text.detokenizer import IncrementalDetokenizer

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
POISON_SEED = 424242


def _engine(model) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), cache=CacheConfig(block_size=8)))


def _run_all(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out = {rid: {"tokens": [], "error": None, "finished": False} for rid in requests}
    while engine.has_unfinished():
        for d in engine.step():
            out[d.request_id]["tokens"] += d.new_token_ids
            out[d.request_id]["error"] = d.error
            out[d.request_id]["finished"] |= d.finished
    return out


@pytest.fixture(scope="module")
def prompts():
    return {f"r{i}": random_prompt(512, 20 + 7 * i, seed=i) for i in range(4)}


@pytest.fixture(scope="module")
def expected(tiny_llama, prompts):
    got = _run_all(_engine(tiny_llama), {rid: (p, GREEDY) for rid, p in prompts.items()})
    return {rid: v["tokens"] for rid, v in got.items()}


def _check_others(out, expected, culprit, engine):
    for rid, v in out.items():
        if rid == culprit:
            assert v["finished"] and v["error"], v
        else:
            assert v["tokens"] == expected[rid] and v["error"] is None, (rid, v)
    assert engine.block_manager.num_free_blocks == engine.runtime.num_blocks
    engine.scheduler.check_integrity()


def test_a_request_whose_sampling_raises_fails_alone(tiny_llama, prompts, expected, monkeypatch):
    real = model_runner.sample

    def sample(logits, params, draws, *args, **kwargs):
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("injected: a seeded row cannot be sampled")
        return real(logits, params, draws, *args, **kwargs)

    monkeypatch.setattr(model_runner, "sample", sample)
    engine = _engine(tiny_llama)
    reqs = {rid: (p, GREEDY) for rid, p in prompts.items()}
    reqs["r2"] = (prompts["r2"], SamplingParams(max_tokens=6, temperature=0.8, seed=POISON_SEED))
    out = _run_all(engine, reqs)
    _check_others(out, expected, "r2", engine)
    assert "sampling failed" in out["r2"]["error"] and "injected" in out["r2"]["error"]
    again = _run_all(engine, {"after": (prompts["r0"], GREEDY)})
    assert again["after"]["tokens"] == expected["r0"]


def test_a_request_whose_output_processing_raises_fails_alone(tiny_llama, prompts, expected, monkeypatch):
    real = IncrementalDetokenizer.add_tokens

    def add_tokens(self, ids):
        if getattr(self, "_poisoned", False):
            raise UnicodeError("injected: detokenizer broke")
        return real(self, ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", add_tokens)
    engine = _engine(tiny_llama)
    for rid, p in prompts.items():
        engine.add_request(rid, p, GREEDY)
    engine.outputs._live["r1"].text.detok._poisoned = True
    out = {rid: {"tokens": [], "error": None, "finished": False} for rid in prompts}
    while engine.has_unfinished():
        for d in engine.step():
            out[d.request_id]["tokens"] += d.new_token_ids
            out[d.request_id]["error"] = d.error
            out[d.request_id]["finished"] |= d.finished
    _check_others(out, expected, "r1", engine)
    assert "output processing failed" in out["r1"]["error"]


def test_a_forward_pass_that_raises_fails_its_step_and_the_engine_goes_on(tiny_llama, prompts, expected):
    engine = _engine(tiny_llama)
    real, calls = engine.runner.model.forward, []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected: CUDA error: an illegal memory access")
        return real(*args, **kwargs)

    engine.runner.model.forward = forward
    out = _run_all(engine, {rid: (p, GREEDY) for rid, p in prompts.items()})
    failed = [rid for rid, v in out.items() if v["error"]]
    assert failed and all("engine step failed" in out[r]["error"] for r in failed)
    for rid, v in out.items():
        assert v["finished"] and (v["error"] or v["tokens"] == expected[rid])
    assert engine.block_manager.num_free_blocks == engine.runtime.num_blocks
    again = _run_all(engine, {rid: (p, GREEDY) for rid, p in prompts.items()})
    assert {rid: v["tokens"] for rid, v in again.items()} == expected


def test_the_node_engine_stays_healthy_after_a_request_fails(tiny_llama, prompts, expected, monkeypatch):
    real = model_runner.sample

    def sample(logits, params, generators, *args, **kwargs):
        if any(p.seed == POISON_SEED for p in params):
            raise OverflowError("injected: seed out of range")
        return real(logits, params, generators, *args, **kwargs)

    monkeypatch.setattr(model_runner, "sample", sample)
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), cache=CacheConfig(block_size=8)))

    async def run(rid, prompt, params):
        tokens, error = [], None
        async for d in engine.generate(prompt, params, rid):
            tokens += d.new_token_ids
            error = d.error or error
        return tokens, error

    async def main():
        bad = SamplingParams(max_tokens=6, temperature=0.5, seed=POISON_SEED)
        return await asyncio.gather(run("bad", prompts["r1"], bad), run("good", prompts["r0"], GREEDY))

    try:
        (bad_tokens, bad_error), (good_tokens, good_error) = asyncio.run(main())
        assert bad_error and "seed out of range" in bad_error and good_tokens == expected["r0"]
        assert engine.is_healthy()
        assert asyncio.run(run("later", prompts["r3"], GREEDY))[0] == expected["r3"]
    finally:
        engine.shutdown()
