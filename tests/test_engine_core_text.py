"""Detokenization in the API process (``--engine-core-process``, issue 14), without processes.

An in-process ``LLMEngine`` (text and stop strings in the engine) is the reference. Against it, a second
engine built as the core builds it (``detokenize=False``: token ids only) feeds its outputs, through the
wire messages, to the API process's ``OutputProcessor``; the stop strings it reports reach the core only
``lag`` steps later (tokens in flight meanwhile). Every delta must equal the reference's, field by field,
and once the requests end the core's blocks are all free. Both tokenizer kinds (byte-level BPE and
SentencePiece/Metaspace, whose byte tokens make partial characters) are covered.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from parity_matrix import _ending_at
from pdserve.engine.config import EngineConfig, SchedulerConfig
from pdserve.engine.core import messages as m
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.output_processor import OutputProcessor
from pdserve.engine.sampling_params import SamplingParams

PROMPT = "The quiet engineer politely asked about the server logs in 1999."


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_llama_metaspace"])
def engines(request):
    config = EngineConfig(model=str(request.getfixturevalue(request.param)),
                          scheduler=SchedulerConfig(max_model_len=512))
    reference, core = LLMEngine(config), LLMEngine(config, detokenize=False)
    yield reference, core
    reference.shutdown()
    core.shutdown()


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **kw})


def _texts(engine: LLMEngine, prompt: list[int], n: int) -> dict[int, str]:
    """The greedy text after k tokens, k = 1..n."""
    engine.add_request("base", prompt, _greedy(max_tokens=n))
    ids = [t for out in _run(engine) for t in out.new_token_ids]
    return {k: engine.tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(1, n + 1)}


def _cases(t: dict[int, str], eos_ok: bool) -> dict[str, SamplingParams]:
    across = _ending_at(t[8], len(t[3]), start_before=len(t[2]))
    return {
        "inside-first-token": _greedy(max_tokens=8, stop=(_ending_at(t[8], len(t[1])),)),
        "across-tokens": _greedy(max_tokens=12, stop=(across,)),
        "include": _greedy(max_tokens=12, stop=(across, "\u2603"), include_stop_str_in_output=True),
        "last-token": _greedy(max_tokens=6, stop=(_ending_at(t[6], len(t[6])),)),
        "min-tokens": _greedy(max_tokens=8, min_tokens=4, stop=(t[1],)),
        "late-in-long": _greedy(max_tokens=200, stop=(_ending_at(t[12], len(t[12])),)),
        "never": _greedy(max_tokens=10, stop=("\u2603\u2603",)),
        "logprobs": _greedy(max_tokens=12, stop=(across,), logprobs=3),
        "eos": SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2 if eos_ok else 0, stop=(t[8][-3:],)),
    }


def _run(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def _through_api(core: LLMEngine, api: OutputProcessor, lag: int) -> list:
    """Step the core; its outputs go over the wire to ``api``; stop strings reach the core ``lag`` steps later."""
    delivered, pending = [], []                 # pending: (steps to wait, request id, stop string)
    while core.has_unfinished() or pending:
        for _, rid, stop in [p for p in pending if p[0] <= 0]:
            core.stop_request(rid, stop)
        pending = [(n - 1, rid, s) for n, rid, s in pending if n > 0]
        outs = core.step() if core.has_unfinished() else []
        batch = m.decode_core_message(m.encode(m.CoreOutputs([m.output_to_wire(o, 1) for o in outs])))
        for wire in batch.outputs:
            out, stop = api.process(wire)
            if stop is not None:
                pending.append((lag, wire.request_id, stop))
            if out is not None:
                delivered.append(out)
    return delivered


def _by_request(outs: list) -> dict[str, list]:
    per = defaultdict(list)
    for out in outs:
        per[out.request_id].append(out)
    return dict(per)


@pytest.mark.parametrize("lag", [0, 3])
def test_api_process_text_equals_in_process(engines, lag):
    reference, core = engines
    prompt = reference.tokenizer.encode(PROMPT)
    cases = _cases(_texts(reference, prompt, 12), eos_ok=True)
    api = OutputProcessor(reference.tokenizer, wait_for_core=False)
    for name, params in cases.items():
        reference.add_request(name, prompt, params)
        core.add_request(name, prompt, params)
        api.add(name, 1, prompt, params)
    expected, got = _by_request(_run(reference)), _by_request(_through_api(core, api, lag))
    assert set(got) == set(cases)
    for name in cases:
        assert got[name] == expected[name], name
    stopped = {n for n, outs in expected.items() if isinstance(outs[-1].stop_reason, str)}
    assert {"inside-first-token", "across-tokens", "include", "late-in-long"} <= stopped
    assert "".join(o.new_text for o in expected["include"]).endswith(cases["include"].stop[0])
    bm = core.block_manager
    assert not core.has_unfinished() and bm.num_free_blocks == bm.num_blocks    # stopped requests freed
    core.scheduler.check_integrity()


def test_in_flight_tokens_after_a_stop_string_are_dropped(engines):
    """The core runs 5 more steps before it hears of the stop: the API delivers nothing of them, and the
    request's blocks are freed once the stop arrives."""
    reference, core = engines
    prompt = reference.tokenizer.encode(PROMPT)
    t = _texts(reference, prompt, 12)
    params = _greedy(max_tokens=300, stop=(_ending_at(t[8], len(t[3]), start_before=len(t[2])),))
    reference.add_request("x", prompt, params)
    expected = _run(reference)
    api = OutputProcessor(reference.tokenizer, wait_for_core=False)
    core.add_request("x", prompt, params)
    api.add("x", 1, prompt, params)
    got, stops = [], []
    while not stops:
        for wire in [m.output_to_wire(o, 1) for o in core.step()]:
            out, stop = api.process(wire)
            got += [out] if out is not None else []
            stops += [stop] if stop is not None else []
    for _ in range(5):                                   # in flight: sampled, sent, dropped
        outs = core.step()
        assert [o.new_token_ids for o in outs] and all(api.process(m.output_to_wire(o, 1)) == (None, None)
                                                       for o in outs)
    assert core.scheduler.num_running == 1 and core.block_manager.num_free_blocks < core.block_manager.num_blocks
    core.stop_request("x", stops[0])
    [final] = core.step()                                 # the core's final output: dropped by the API
    assert final.finished and final.finish_reason == "stop" and final.new_token_ids == []
    assert api.process(m.output_to_wire(final, 1)) == (None, None)
    assert got == expected and got[-1].stop_reason == stops[0]
    assert sum(len(o.new_token_ids) for o in got) == sum(len(o.new_token_ids) for o in expected)
    assert not core.has_unfinished() and core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_a_final_output_waits_for_the_core_with_a_store(engines):
    """``wait_for_core``: the stop-string-ended output is delivered with the core's final output's KV
    figures (here: a fake core final with accounting), not before."""
    reference, core = engines
    prompt = reference.tokenizer.encode(PROMPT)
    t = _texts(reference, prompt, 8)
    params = _greedy(max_tokens=50, stop=(_ending_at(t[8], len(t[3]), start_before=len(t[2])),))
    api = OutputProcessor(reference.tokenizer, wait_for_core=True)
    core.add_request("y", prompt, params)
    api.add("y", 1, prompt, params)
    got, stop = [], None
    while stop is None:
        for o in core.step():
            out, stop = api.process(m.output_to_wire(o, 1))
            got += [out] if out is not None else []
    assert not any(o.finished for o in got)
    core.stop_request("y", stop)
    [final] = core.step()
    final.kv_accounting = {"total_tokens": len(prompt)}
    out, again = api.process(m.output_to_wire(final, 1))
    assert again is None and out.finished and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.kv_accounting == {"total_tokens": len(prompt)} and out.new_token_ids
