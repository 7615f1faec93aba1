"""Review 14 (detokenization in the API process, ``--engine-core-process``): two ways the core's answers
differed from the in-process engine's.

1. A request id re-added right after a stop string ended it: the API process delivers the final output and
   sends ``StopRequests``; the new ``AddRequest`` reaches the core in the same batch. The core's final
   output of the stopped add (from ``stop_request``) was sent after the batch, with the seq looked up then:
   the new add's. The new request received the old one's empty "stop" final output, and its own outputs
   were dropped (seq popped) while it ran on in the core.
2. P/D: the prefill node's first token already completes a stop string. In-process, the decode node ends
   the request at add (never scheduled, no KV load: ``kv_accounting`` of a request that loaded nothing);
   the core could not see the string, scheduled it and loaded its prompt KV from the store before the
   ``StopRequests`` came: ``usage.kv_transfer.decode`` differed and the load was wasted.

Both are checked on ``CoreLoop`` with a fake outbox (no process) against the in-process engine, and the
first end to end through ``AsyncEngine``.
"""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.engine.core import messages as m
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.output_processor import OutputProcessor
from pdserve.engine.core.proc import CoreLoop
from pdserve.engine.kv.kv_transfer import KVTransferParams
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.text.tokenizer import load_tokenizer
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore

PROMPT = "The quiet engineer politely asked about the server logs in 1999."
PROMPTS = (PROMPT, "Every student never forgot three green apples before noon.", "What is the capital of France?",
           "Her younger brother bravely crossed the winter garden before noon.", "hello world")


class _Outbox:
    def __init__(self):
        self.sent = []

    def send(self, msg) -> None:
        self.sent.append(m.decode_core_message(m.encode(msg)))


class _Core:
    """A ``CoreLoop`` and the API process's ``OutputProcessor``, one turn at a time."""

    def __init__(self, engine: LLMEngine, wait_for_core: bool):
        self.engine, self.box = engine, _Outbox()
        self.loop = CoreLoop(engine, None, self.box)
        self.api = OutputProcessor(load_tokenizer(engine.config.model), wait_for_core=wait_for_core)   # the API's own

    def turn(self, messages=()) -> list:
        """Apply ``messages``, step, send: -> what the API process delivers."""
        rejected, _ = self.loop._apply(list(messages))
        outs = self.engine.step() if self.engine.has_unfinished() else []
        n = len(self.box.sent)
        self.loop._send(outs, rejected)
        delivered = [self.api.process(w)[0] for msg in self.box.sent[n:] for w in msg.outputs]
        return [d for d in delivered if d is not None]

    def run(self) -> list:
        outs = []
        while self.engine.has_unfinished():
            outs += self.turn()
        return outs


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **kw})


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_an_id_re_added_with_the_stop_in_one_batch_gets_its_own_outputs(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), scheduler=SchedulerConfig(max_model_len=512)),
                       detokenize=False)
    try:
        core = _Core(engine, wait_for_core=False)
        prompt = core.api.tokenizer.encode(PROMPT)
        old, new = _greedy(max_tokens=400), _greedy(max_tokens=4)
        core.api.add("X", 1, prompt, old)
        core.turn([m.AddRequest("X", 1, prompt, old)])
        core.turn()
        # the API process found a stop string in X #1, delivered its end, and X is added again at once
        core.api.remove("X")
        core.api.add("X", 2, [100, 101, 102], new)
        got = core.turn([m.StopRequests(["X"], ["ab"]), m.AddRequest("X", 2, [100, 101, 102], new)]) + core.run()
        engine.add_request("ref", [100, 101, 102], new)
        expected = _run(engine)
        assert _tokens(got) == _tokens(expected) and len(_tokens(got)) == 4
        assert got[-1].finished and got[-1].finish_reason == "length" and got[-1].stop_reason is None
        assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.shutdown()


def _run(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_an_id_re_added_right_after_a_stop_string_end_to_end(tiny_llama):
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), engine_core_process=True))
    tok = engine.engine.tokenizer
    prompt = tok.encode(PROMPT)

    async def run(ids, params, rid) -> list:
        return [o async for o in engine.generate(ids, params, rid)]

    async def main() -> tuple[list, list]:
        ids = _tokens(await run(prompt, _greedy(max_tokens=8), "base"))
        text = tok.decode(ids[:6], skip_special_tokens=True)
        stop = next(text[-n:] for n in range(2, 7) if text[-n:].strip() and "\ufffd" not in text[-n:])
        expected = _tokens(await run([100, 101, 102], _greedy(max_tokens=8), "ref"))
        got = []
        for _ in range(5):
            ended = await run(prompt, _greedy(max_tokens=1500, stop=(stop,)), "X")
            assert ended[-1].stop_reason == stop
            got.append(_tokens(await run([100, 101, 102], _greedy(max_tokens=8), "X")))   # the same id, at once
        return expected, got

    try:
        expected, got = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(expected) == 8 and got == [expected] * 5


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_llama_metaspace"])
def test_a_prefill_token_that_completes_a_stop_string_ends_the_request_at_add(request, model):
    model_dir = str(request.getfixturevalue(model))
    store = TieredStore(MemoryTier(256 << 20))

    def engine(role: str, detokenize: bool = True) -> LLMEngine:
        return LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(block_size=4, enable_prefix_caching=False),
                                      scheduler=SchedulerConfig(max_model_len=512),
                                      kv_transfer=KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=4)),
                         store=store, detokenize=detokenize)

    prefill, reference, core_engine = engine("prefill"), engine("decode"), engine("decode", detokenize=False)
    try:
        for i, text in enumerate(PROMPTS):       # a prompt whose first greedy token is whole text
            prompt = prefill.tokenizer.encode(text)
            prefill.add_request(f"p{i}", prompt, _greedy(max_tokens=1), {"do_remote_decode": True})
            [pf] = [o for o in _run(prefill) if o.finished]
            if pf.new_text.strip() and "\ufffd" not in pf.new_text:
                break
        transfer = pf.kv_transfer_params
        params = _greedy(max_tokens=8, stop=(pf.new_text.strip(),))
        reference.add_request("d", prompt, params, transfer)
        expected = _run(reference)
        assert expected[-1].stop_reason == params.stop[0] and expected[-1].kv_accounting["loaded_tokens"] == 0

        core = _Core(core_engine, wait_for_core=True)
        core.api.add("d", 1, prompt, params)
        stop = core.api.first_token_stop(prompt, params, KVTransferParams.from_json_obj(transfer))
        got = core.turn([m.AddRequest("d", 1, prompt, params, KVTransferParams.from_json_obj(transfer), stop)])
        got += core.run()
        assert got == expected
        bm = core_engine.block_manager
        assert not core_engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks
    finally:
        for e in (prefill, reference, core_engine):
            e.shutdown()
        store.close()
