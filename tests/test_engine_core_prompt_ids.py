"""A prompt token id the model cannot take fails its request up front, with the engine core in its own process.

A float, bool or NaN id used to reach the core's message decoder (``Expected int``) and end the core
process, failing every request and stopping the node; an id outside the vocabulary reached the
embedding lookup and failed every request of its step. ``AsyncEngine.generate`` now raises ValueError
naming the id before anything is sent, the neighbouring request's tokens equal a run alone, and the core
stays up. (The HTTP edge rejects such ids with a 400 already; this is the Python callers' path.)
"""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.sampling_params import SamplingParams

PROMPT = [100, 101, 102, 103]
BAD = [(2.0, "is not an integer"), (True, "is not an integer"), (float("nan"), "is not an integer"),
       (-5, "is out of range"), (2**70, "is out of range"), (512, "is out of range")]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), engine_core_process=True))
    yield engine
    engine.shutdown()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def _tokens(engine, ids, rid: str):
    try:
        return [t for o in [o async for o in engine.generate(ids, _greedy(6), rid)] for t in o.new_token_ids]
    except ValueError as exc:
        return exc


@pytest.mark.parametrize("bad, message", BAD)
def test_a_bad_id_fails_its_request_only_and_the_core_stays_up(engine, bad, message):
    async def main():
        alone = await _tokens(engine, PROMPT, f"alone-{message}-{bad!r}")
        failed, good = await asyncio.gather(_tokens(engine, [1, bad, 3], f"bad-{bad!r}"),
                                            _tokens(engine, PROMPT, f"good-{bad!r}"))
        return alone, failed, good

    alone, failed, good = asyncio.run(main())
    assert isinstance(failed, ValueError) and f"prompt token id {bad!r} {message}" in str(failed)
    assert len(alone) == 6 and good == alone
    assert engine.engine.is_alive()
