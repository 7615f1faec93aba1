"""The node hands a request to the engine before its response begins, and takes it back if the response
never runs (``Generation.start`` / ``Generation.close``, ``AsyncEngine.submit``).

In a burst the pump tasks that used to send each add ran only after the event loop had taken in every other
arriving request, so the engine's first steps started with one or two prompts of 32. The requests are now
submitted synchronously by the handler; the cost is that a response that never iterates its stream (the
client left before it started) must abort them itself. Real engine (the tiny Llama, in process), real
``ServerMetrics``.
"""

from __future__ import annotations

import asyncio
import time

from hf_reference import random_prompt
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.server.generation import EngineCall, Generation
from pdserve.engine.server.metrics import ServerMetrics

MAX_TOKENS = 1800


def _engine(model) -> AsyncEngine:
    return AsyncEngine(EngineConfig(model=str(model), cache=CacheConfig(block_size=8),
                                    scheduler=SchedulerConfig(max_model_len=2048)))


def _calls(n: int) -> list[EngineCall]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [EngineCall(f"adm-{i}", i, random_prompt(512, 40, seed=i), params) for i in range(n)]


def _wait_idle(engine: AsyncEngine, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.engine.has_unfinished():
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.01)


def test_a_generation_is_in_the_engine_before_its_stream_is_read(tiny_llama):
    """``start`` sends every call at once (no await): the engine steps them while nobody reads yet.
    Mutation caught: ``Generation.start`` doing nothing (submission back in the pump tasks) -> no step runs."""
    engine = _engine(tiny_llama)
    try:
        async def scenario():
            gen = Generation(engine, ServerMetrics(engine, engine.model_name), _calls(2), time.monotonic())
            gen.start()
            deadline = time.monotonic() + 30
            while engine.engine.scheduler.num_running < 2:     # no await of ours lets a pump run: not one exists
                assert time.monotonic() < deadline, "the engine never got the requests"
                time.sleep(0.01)
            await gen.close()

        asyncio.run(scenario())
        _wait_idle(engine)
    finally:
        engine.shutdown()


def test_a_response_that_never_streams_aborts_its_requests(tiny_llama):
    """The client left before the SSE response iterated ``outputs``: ``close`` (the response's ``on_close``)
    aborts what was submitted, so the blocks come back and the engine does not run 1800 tokens for nobody.
    Mutation caught: ``Generation.close`` returning without aborting -> the requests run to max_tokens."""
    engine = _engine(tiny_llama)
    free_at_start = engine.engine.block_manager.num_free_blocks
    try:
        queues = {}

        async def scenario():
            gen = Generation(engine, ServerMetrics(engine, engine.model_name), _calls(3), time.monotonic())
            gen.start()
            queues.update(gen._submitted)
            await gen.close()
            await gen.close()                                  # idempotent
            deadline = time.monotonic() + 60                   # the loop stays up: deliveries still land
            while engine.engine.has_unfinished():
                assert time.monotonic() < deadline, "the engine never went idle"
                await asyncio.sleep(0.01)

        asyncio.run(scenario())
        tokens = {rid: sum(len(q.get_nowait().new_token_ids) for _ in range(q.qsize())) for rid, q in queues.items()}
        assert all(n < MAX_TOKENS for n in tokens.values()), tokens
        assert engine.engine.block_manager.num_free_blocks == free_at_start
        engine.engine.scheduler.check_integrity()
    finally:
        engine.shutdown()
