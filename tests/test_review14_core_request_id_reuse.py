"""Review 14: a request id reused right after its abort receives the aborted request's last outputs.

``AsyncEngine`` with ``engine_core_process``: ``abort(X)`` pops X's stream in the caller's thread and posts
``AbortRequests``; a new ``generate(..., "X")`` registers a new stream under the same key and posts
``AddRequest``. Every ``CoreOutputs`` the core sent for the old X before it applied the abort (at least the
step it was in) reaches the receiver thread after that, finds the new stream under "X" and is delivered
to it: the new request starts with the old request's token (and gets max_tokens + 1 tokens). The
in-process engine never does this (the engine thread pops the stream and applies the abort before it
steps again). To make the window certain, the core is SIGSTOPped while the old X runs, the abort and the
new add are sent, then SIGCONT: the core finishes the step it was in and sends X's token first.

Suggested fix: key deliveries by an engine-internal id per add (``f"{request_id}#{seq}"`` in AddRequest /
AbortRequests / CoreOutput, mapped back in the client), or keep an aborted id in a tombstone set until
the core acknowledges the abort and drop outputs for it until then.
"""

from __future__ import annotations

import asyncio
import os
import signal

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.sampling_params import SamplingParams

OLD_PROMPT, NEW_PROMPT = [5, 6, 7, 8, 9], [100, 101, 102]
TRIALS = 5


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def _tokens(engine: AsyncEngine, prompt: list[int], max_tokens: int, request_id: str) -> list[int]:
    tokens = []
    async for out in engine.generate(prompt, _params(max_tokens), request_id):
        tokens += out.new_token_ids
    return tokens


def test_a_request_id_reused_after_its_abort_gets_only_its_own_tokens(tiny_llama):
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), engine_core_process=True))
    core = engine.engine.pid

    async def main() -> list[list[int]]:
        expected = await _tokens(engine, NEW_PROMPT, 8, "reference")
        got = []
        for _ in range(TRIALS):
            old = engine.generate(OLD_PROMPT, _params(1500), "X")
            seen = 0
            async for _out in old:                            # the old X is decoding in the core
                seen += 1
                if seen == 3:
                    break
            os.kill(core, signal.SIGSTOP)                     # the core is mid-loop with X running
            try:
                await asyncio.sleep(0.3)                      # what it sent before the stop is delivered
                await old.aclose()                            # abort X (its stream is dropped at once)
                new = asyncio.ensure_future(_tokens(engine, NEW_PROMPT, 8, "X"))   # the same id, at once
                await asyncio.sleep(0.3)
            finally:
                os.kill(core, signal.SIGCONT)
            got.append(await asyncio.wait_for(new, 120))
        return [expected] + got

    try:
        expected, *got = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(expected) == 8
    assert got == [expected] * TRIALS
