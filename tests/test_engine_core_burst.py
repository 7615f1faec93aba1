"""A burst's first step takes every add that has arrived (issue 38): ``CoreLoop.turn`` drains the inbox
before it schedules, so adds queued on the socket while the core was busy or idle are all in one step.

A real zmq socket pair and the real engine; each prompt's prefill emits its first token in the step that
scheduled it, so the first turn's ``CoreOutputs`` names every request of the burst.
"""

from __future__ import annotations

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


def _burst(sender: zmq.Socket, count: int, prompt_len: int) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    ids = [f"burst-{i}" for i in range(count)]
    for i, request_id in enumerate(ids):
        prompt = [(7 * i + j) % 200 + 3 for j in range(prompt_len)]
        sender.send(m.encode(m.AddRequest(request_id, i + 1, prompt, params)))
    return ids


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
