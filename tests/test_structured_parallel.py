"""Structured outputs on a tp x pp engine (issue 37): each structured request's bitmask row travels in its
``StepRequest`` to the sampling rank, so a tp 2 x pp 2 engine (micro-batches mixing structured and plain rows)
gives the single-process engine's tokens, greedy and seeded, and every answer matches its constraint.
"""

from __future__ import annotations

import re

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured.spec import StructuredOutputs
from test_parallel_engine import make_engine, run, shutdown
from test_structured_engine import CHOICES, PROMPT, REGEX, SPECS, check_schema


def test_tp_pp_engine_equals_single_process(tiny_llama):
    params = [SamplingParams(max_tokens=150, temperature=0.0, structured=SPECS["json"]),
              SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured=StructuredOutputs(regex=REGEX)),
              SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, seed=8, structured=SPECS["choice"])]
    single = make_engine(tiny_llama)
    prompts = [single.tokenizer.encode(PROMPT + " " * i) for i in range(len(params))]
    try:
        want = run(single, prompts, params)
    finally:
        single.shutdown()
    parallel = make_engine(tiny_llama, tp=2, pp=2)
    try:
        got = run(parallel, prompts, params)
        texts = [parallel.tokenizer.decode(ids, skip_special_tokens=True) for ids in got]
    finally:
        shutdown(parallel)
    assert got == want
    check_schema(texts[0])
    assert re.fullmatch(REGEX, texts[1]) and len(got[2]) == 9 and texts[3] in CHOICES, texts
