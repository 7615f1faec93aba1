"""Extreme values in every ``SamplingParams`` field, straight at the engine (``LLMEngine`` in-process,
tiny llama): each set either raises ``SamplingParamsError`` when it is built, or runs to completion --
no error, a stop or length finish, its blocks freed -- beside a greedy bystander that gets exactly its
solo answer, and the engine keeps stepping.

Before (SamplingParams of issue 10 + the engine's failure isolation): hypothesis found within a few
examples sets that passed construction and then failed their request in the step -- a seed of 2^64
(generator overflow), a temperature of 1e-40 or a repetition penalty of 1e-38 (NaN probabilities),
top_k=2.5 (a float index), a stop id past the vocabulary with min_tokens (IndexError). Issue 37 added
presence_penalty, frequency_penalty and logit_bias (ids within the tiny model's vocabulary of 512: the engine
refuses the others at add, by name).
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine, PromptTooLongError
from pdserve.engine.sampling_params import SamplingParams, SamplingParamsError

MAX_MODEL_LEN = 64
PROMPT = [5, 17, 42, 99, 3, 250, 7, 8]
BYSTANDER = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
_ids = itertools.count()

BIG_INTS = st.sampled_from([-2**64, -2**63 - 1, -2**63, -1, 0, 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**40])
ANY_INT = st.one_of(BIG_INTS, st.integers(-3, 600), st.integers(), st.booleans(), st.just(2.5))
ANY_FLOAT = st.one_of(st.sampled_from([math.inf, -math.inf, math.nan, -1e-9, -0.0]), st.floats(), st.integers(-2, 3),
                      st.booleans())


def _extreme(values: list, within: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.sampled_from(values), within)


# Per field: values the range allows, at its extremes (drawn 7 times in 8), or anything at all.
VALID = {
    "max_tokens": st.integers(1, 6),
    "temperature": _extreme([0.0, 5e-324, 1e-45, 1e-40, 1e-38, 1e-6, 1e-5, 1.0001e-5, 0.5, 2.0, 1e6],
                            st.floats(0, 1e6)),
    "top_p": _extreme([5e-324, 1e-300, 1e-10, 0.5, 1.0], st.floats(0, 1, exclude_min=True)),
    "top_k": _extreme([-1, 0, 1, 2, 511, 512, 513, 2**63, 10**40], st.integers(0)),
    "min_p": _extreme([0.0, 5e-324, 1e-10, 0.5, 1.0], st.floats(0, 1)),
    "seed": st.one_of(st.none(), _extreme([-2**63, -1, 0, 2**63 - 1, 2**64 - 1], st.integers(-2**63, 2**64 - 1))),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(_extreme([0, 1, 2, 511, 512, 2**40], st.integers(0, 2**70)), max_size=4),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "repetition_penalty": _extreme([1e-3, 0.01, 1.0, 2.0, 1e3], st.floats(1e-3, 1e3)),
    "presence_penalty": _extreme([-2.0, -1e-300, 0.0, 5e-324, 2.0], st.floats(-2, 2)),
    "frequency_penalty": _extreme([-2.0, -1e-300, 0.0, 5e-324, 2.0], st.floats(-2, 2)),
    "logit_bias": st.dictionaries(_extreme([0, 1, 2, 511], st.integers(0, 511)),
                                  _extreme([-100.0, -1e-300, 0.0, 100.0], st.floats(-100, 100)), max_size=4),
    "min_tokens": _extreme([0, 1, 5, 2**31, 2**70], st.integers(0)),
    "include_stop_str_in_output": st.booleans(),
}
FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
ANY_BIAS = st.one_of(st.dictionaries(st.one_of(ANY_INT, st.text(max_size=3)), st.one_of(ANY_FLOAT, ANY_INT),
                                     max_size=3),
                     st.lists(st.one_of(st.tuples(ANY_INT, ANY_FLOAT), st.tuples(ANY_INT), ANY_INT), max_size=3),
                     st.none(), ANY_INT, st.text(max_size=3))
ANYTHING = {name: ANY_FLOAT if name in FLOATS else ANY_BIAS if name == "logit_bias" else
            st.lists(st.one_of(ANY_INT, st.text(max_size=2)), max_size=3) if name in ("stop", "stop_token_ids") else
            st.one_of(st.none(), ANY_INT) for name in VALID}
FIELDS = {name: st.integers(0, 7).flatmap(lambda k, name=name: VALID[name] if k else ANYTHING[name])
          for name in VALID}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=str(tiny_llama), cache=CacheConfig(block_size=8, num_gpu_blocks_override=64),
                                  scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN)))


@pytest.fixture(scope="module")
def solo(engine) -> list[int]:
    return _run(engine, {"solo": (PROMPT, BYSTANDER)})["solo"]["tokens"]


def _run(engine, requests: dict) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out = {rid: {"tokens": [], "error": None, "finish_reason": None} for rid in requests}
    for _ in range(10 * MAX_MODEL_LEN):
        if not engine.has_unfinished():
            return out
        for delta in engine.step():
            got = out[delta.request_id]
            got["tokens"] += delta.new_token_ids
            got["error"] = got["error"] or delta.error
            got["finish_reason"] = delta.finish_reason if delta.finished else got["finish_reason"]
    raise AssertionError(f"the engine did not finish {list(requests)} in {10 * MAX_MODEL_LEN} steps")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(fields=st.fixed_dictionaries({}, optional=FIELDS))
def test_every_field_is_refused_at_construction_or_runs(engine, solo, fields):
    try:
        params = SamplingParams(**fields)
    except SamplingParamsError as exc:
        event(f"refused: {getattr(exc, 'param', None)}")
        return
    free = engine.block_manager.num_free_blocks
    n = next(_ids)
    requests = {f"fuzz-{n}": (PROMPT, params), f"bystander-{n}": (PROMPT, BYSTANDER)}
    if len(PROMPT) + params.max_tokens > MAX_MODEL_LEN:          # the engine's own length check, up front
        with pytest.raises(PromptTooLongError):
            engine.add_request(f"fuzz-{n}", PROMPT, params)
        event("refused: longer than --max-model-len")
        return
    if any(t >= engine.model_config.vocab_size for t, _ in params.logit_bias):   # the engine's vocabulary check
        with pytest.raises(ValueError, match="logit_bias token id .* is out of range; the vocabulary has 512"):
            engine.add_request(f"fuzz-{n}", PROMPT, params)
        event("refused: logit_bias past the vocabulary")
        return
    event("ran")
    out = _run(engine, requests)
    fuzz, bystander = out[f"fuzz-{n}"], out[f"bystander-{n}"]
    assert fuzz["error"] is None and fuzz["finish_reason"] in ("stop", "length"), (params, fuzz)
    assert 1 <= len(fuzz["tokens"]) <= params.max_tokens
    assert bystander == {"tokens": solo, "error": None, "finish_reason": "length"}
    assert engine.block_manager.num_free_blocks == free
    engine.block_manager.check_integrity()
