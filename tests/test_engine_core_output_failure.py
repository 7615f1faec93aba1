"""One request whose text cannot be made in the API process (``--engine-core-process``) fails alone.

The in-process node catches a detokenizer / stop-string exception per request (``OutputAssembler.fail``);
with the engine core in its own process that work runs in the API process's receiver thread, where an
escaping exception used to end the whole node ("the engine-core link failed"). Here the API side's
processing raises for one request id: that request ends with an error, its neighbour's tokens equal a
run alone, the core aborts it (no request left running, every block free) and the node keeps serving.
"""

from __future__ import annotations

import asyncio

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.core.output_processor import OutputProcessor
from pdserve.engine.sampling_params import SamplingParams
from polling import wait_until

PROMPT = [100, 101, 102, 103]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_an_output_processing_error_fails_that_request_only(tiny_llama, monkeypatch):
    real = OutputProcessor._detokenize

    def fails_for_bad(self, r, wire):
        if wire.request_id.startswith("bad"):
            raise RuntimeError("boom in the API process")
        return real(self, r, wire)

    monkeypatch.setattr(OutputProcessor, "_detokenize", fails_for_bad)
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), engine_core_process=True))

    async def run(rid: str, n: int) -> list:
        return [o async for o in engine.generate(PROMPT, _greedy(n), rid)]

    async def main():
        alone = await run("alone", 24)
        bad, good = await asyncio.gather(run("bad-1", 200), run("good", 24))
        after = await run("after", 24)
        return alone, bad, good, after

    try:
        alone, bad, good, after = asyncio.run(main())
        assert bad[-1].finished and bad[-1].finish_reason == "abort"
        assert "boom in the API process" in bad[-1].error
        tokens = [[t for o in outs for t in o.new_token_ids] for outs in (alone, good, after)]
        assert len(tokens[0]) == 24 and tokens[1] == tokens[0] and tokens[2] == tokens[0]
        assert engine.engine.is_alive()
        wait_until(lambda: engine.stats().num_running == 0
                   and engine.stats().num_free_blocks == engine.stats().num_blocks, 30,
                   "the core aborted the failed request and freed its blocks")
    finally:
        engine.shutdown()
