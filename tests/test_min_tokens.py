"""The min_tokens ban on eos and stop ids lifts exactly at ``min_tokens`` (issue 43).

Mutation caught: ``num_output_tokens > params.min_tokens`` in ``Request.banned_token_ids`` (instead of ``>=``) --
eos and stop ids stayed banned one token past ``min_tokens``, and with ``min_tokens=0`` eos was banned as the
first token. Checked on the request itself and end to end on the real engine (greedy, the tiny Llama).
"""

from __future__ import annotations

import pytest

from engine_run import run_request
from pdserve.engine.config import EngineConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.request import Request

EOS = 2


@pytest.mark.parametrize("min_tokens", [0, 1, 3])
def test_the_ban_holds_before_min_tokens_and_lifts_at_it(min_tokens):
    req = Request("r", [5, 6, 7], SamplingParams(min_tokens=min_tokens, max_tokens=10, stop_token_ids=[9]),
                  eos_token_id=EOS, arrival_time=0.0)
    for produced in range(min_tokens + 2):
        assert req.num_output_tokens == produced
        assert req.banned_token_ids == ((EOS, 9) if produced < min_tokens else ())
        req.append_output_token(11)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    e = LLMEngine(EngineConfig(model=str(tiny_llama), scheduler=SchedulerConfig(max_model_len=256)))
    yield e
    e.shutdown()


def _greedy(engine, prompt, **kw):
    tokens, final = run_request(engine, f"r{len(kw)}-{sorted(kw.items())}", prompt,
                                SamplingParams(temperature=0.0, **kw))
    return tokens, final


def test_a_stop_id_equal_to_the_token_at_min_tokens_stops_there(engine):
    """Greedy token ``min_tokens`` (0-based) is a stop id that did not come earlier: the answer ends with it."""
    min_tokens = 3
    for seed in range(20):                                  # a prompt whose 4th greedy token is new
        prompt = [(seed * 37 + 11 * j) % 400 + 5 for j in range(12)]
        free, _ = _greedy(engine, prompt, max_tokens=10, ignore_eos=True)
        if free[min_tokens] not in free[:min_tokens]:
            break
    else:
        pytest.fail("no prompt whose greedy token at min_tokens is new")
    stop = free[min_tokens]
    tokens, final = _greedy(engine, prompt, max_tokens=10, ignore_eos=True, min_tokens=min_tokens,
                            stop_token_ids=[stop])
    assert tokens == free[:min_tokens + 1]
    assert final.finish_reason == "stop" and final.stop_reason == stop


def test_with_min_tokens_0_the_first_token_may_be_eos(engine):
    eos = engine.tokenizer.eos_token_id
    prompt = [17, 23, 99, 140, 7]
    tokens, final = _greedy(engine, prompt, max_tokens=5, min_tokens=0, logit_bias={eos: 100.0})
    assert tokens == [eos] and final.finish_reason == "stop"
    tokens, final = _greedy(engine, prompt, max_tokens=5, min_tokens=1, logit_bias={eos: 100.0})
    assert tokens[0] != eos and len(tokens) == 2 and tokens[1] == eos   # banned once, then allowed
