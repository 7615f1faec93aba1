"""``CoreLoop.turn`` over a real zmq socket pair and the real engine.

- A burst's first step takes every add that has arrived (issue 38): the inbox is drained before scheduling, so
  adds queued on the socket while the core was busy or idle are all in one step. Each prompt's prefill emits its
  first token in the step that scheduled it, so the first turn's ``CoreOutputs`` names every request of the burst.
- One ``AbortRequests`` naming several ids ends every one of them (issue 43).
"""

from __future__ import annotations

import pytest
import zmq

from pdserve.engine.config import EngineConfig, SchedulerConfig
from pdserve.engine.core import messages as m
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.proc import CoreLoop
from pdserve.engine.sampling_params import SamplingParams


class _Outbox:
    def __init__(self):
        self.sent = []

    def send(self, msg) -> None:
        self.sent.append(m.decode_core_message(m.encode(msg)))


def _burst(sender: zmq.Socket, count: int, prompt_len: int, max_tokens: int = 2) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"burst-{i}" for i in range(count)]
    for i, request_id in enumerate(ids):
        prompt = [(7 * i + j) % 200 + 3 for j in range(prompt_len)]
        sender.send(m.encode(m.AddRequest(request_id, i + 1, prompt, params)))
    return ids


@pytest.fixture()
def core(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), scheduler=SchedulerConfig(
        max_model_len=512, max_num_batched_tokens=1024)), detokenize=False)
    ctx = zmq.Context()
    inbox, sender = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind("inproc://core-loop")
    sender.connect("inproc://core-loop")
    try:
        yield engine, sender, CoreLoop(engine, inbox, _Outbox())
    finally:
        inbox.close(0)
        sender.close(0)
        ctx.term()
        engine.shutdown()


def test_one_abort_message_ends_every_request_it_names(core):
    """Mutation caught: ``_apply`` aborts only the first id of an ``AbortRequests`` -- the second request ran on in
    the core to its ``max_tokens``, holding its blocks."""
    engine, sender, loop = core
    ids = _burst(sender, 3, 40, max_tokens=400)
    assert loop.turn() is None and engine.scheduler.num_running == 3
    sender.send(m.encode(m.AbortRequests(ids[:2])))
    assert loop.turn() is None
    assert [r.request_id for r in engine.scheduler.running] == [ids[2]]
    sender.send(m.encode(m.AbortRequests([ids[2], "never-added"])))
    assert loop.turn() is None
    assert not engine.has_unfinished() and engine.scheduler.num_running == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_first_step_of_a_burst_schedules_every_add_already_sent(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), scheduler=SchedulerConfig(
        max_model_len=512, max_num_batched_tokens=1024)), detokenize=False)
    ctx = zmq.Context()
    inbox, sender = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        inbox.bind("inproc://burst")
        sender.connect("inproc://burst")
        ids = _burst(sender, 6, 100)                     # 600 prompt tokens: one step's budget holds them all
        box = _Outbox()
        loop = CoreLoop(engine, inbox, box)
        assert loop.turn() is None
        first = [o.request_id for msg in box.sent for o in msg.outputs]
        assert sorted(first) == sorted(ids)              # not just the first add: all six prefilled at once
        while engine.has_unfinished():
            assert loop.turn() is None
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        inbox.close(0)
        sender.close(0)
        ctx.term()
        engine.shutdown()
