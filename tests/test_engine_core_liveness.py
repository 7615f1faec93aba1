"""The engine-core process: a step longer than --rank-timeout is not a hang (review 14).

A hung core (SIGSTOP) is caught by ``test_review14_core_hung.py``; here the other side of that check: a
step longer than --rank-timeout (PDSERVE_FAULTS=slow_step, ``engine/parallel/faults.py``: the core sleeps
before each step, so no machine is fast enough to dodge it) still answers, because the core's heartbeat
thread speaks while the step runs.
"""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.config import CORE_MIN_TIMEOUT_S, ConfigError, EngineConfig, ParallelConfig
from pdserve.engine.core import messages as m
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.sampling_params import SamplingParams

TIMEOUT_S = 2.0
SLOW_STEP_S = 2 * TIMEOUT_S


def test_a_step_longer_than_the_timeout_is_not_a_hang(tiny_llama, monkeypatch):
    """Mutation caught: no ``Heartbeat`` thread in the core -> the client kills it after TIMEOUT_S."""
    monkeypatch.setenv("PDSERVE_FAULTS", f"slow_step={SLOW_STEP_S}")        # read by the core it spawns
    config = EngineConfig(model=str(tiny_llama), engine_core_process=True,
                          parallel=ParallelConfig(rank_timeout=TIMEOUT_S))
    engine = AsyncEngine(config)

    async def tokens() -> list[int]:
        got = []
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for out in engine.generate([5, 6, 7], params, "slow"):
            got += out.new_token_ids
        return got

    try:
        assert len(asyncio.run(tokens())) == 2                 # two steps, each 2 x the timeout
        assert engine.fatal is None and engine.is_healthy()
    finally:
        engine.shutdown()


def test_the_timeout_leaves_room_for_several_heartbeats(tiny_llama):
    assert CORE_MIN_TIMEOUT_S >= 4 * m.HEARTBEAT_S
    with pytest.raises(ConfigError, match="--rank-timeout 1 is too short for --engine-core-process"):
        EngineConfig(model=str(tiny_llama), engine_core_process=True, parallel=ParallelConfig(rank_timeout=1.0))
