"""The engine-core link's messages (``pdserve.engine.core.messages``) survive a round trip, field by field
(text aside: the core sends token ids, the API process detokenizes)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

from pdserve.engine.config import EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.engine.core import messages as m
from pdserve.engine.kv.kv_transfer import KVTransferParams
from pdserve.engine.outputs import EngineStats, RequestOutput
from pdserve.engine.runner.sampler import SampleResult
from pdserve.engine.sampling_params import SamplingParams

STATS = EngineStats(num_running=1, num_waiting=2, kv_usage=0.25, prefix_cache_queries=10, prefix_cache_hits=4,
                    kv_totals={"total_tokens": 7}, kv_store={"l1": {"hits": 3, "bytes": 1.5}},
                    kv_transfer={"load_failures": 0}, num_free_blocks=30, num_blocks=40)


def test_client_messages_round_trip():
    params = SamplingParams(max_tokens=7, temperature=0.5, seed=2**64 - 1, stop=("x", "yz"), stop_token_ids=(3,),
                            logprobs=2, min_tokens=1, include_stop_str_in_output=True)
    transfer = KVTransferParams(do_remote_prefill=True, chunk_keys=["a"], chunk_digests=["0f"], first_token_id=5,
                                first_token_top_logprobs=[(5, -0.5)], sampler_draws=1, accounting={"total_tokens": 9})
    for msg in (m.AddRequest("r1", 1, [1, 2, 3], params, transfer), m.AddRequest("r2", 2, [4], SamplingParams()),
                m.AddRequest("r3", 3, [4], SamplingParams(), cache_salt="tenant-é"),
                m.AbortRequests(["r1", "r2"]), m.StopRequests(["r1"], ["\n\n"]), m.Shutdown("bye")):
        assert m.decode_client_message(m.encode(msg)) == msg


def test_core_messages_round_trip():
    out = RequestOutput("r1", [5, 6], "ab", True, "stop", 3, 1,
                        logprobs=[SampleResult(5, -0.25, [(5, -0.25), (9, -1.5)]), SampleResult(6, -0.125, None)],
                        kv_transfer_params=KVTransferParams(do_remote_prefill=True, num_tokens=4).to_json_obj(),
                        kv_accounting={"total_tokens": 3}, stop_reason=6)
    batch = m.CoreOutputs([m.output_to_wire(out, 7)],
                          [m.Rejected("r2", 8, "PromptTooLongError", "prompt is empty", True)], STATS)
    back = m.decode_core_message(m.encode(batch))
    assert back == batch and m.output_from_wire(back.outputs[0]) == replace(out, new_text="")
    assert back.outputs[0].seq == 7 and back.outputs[0].stop_reason == 6
    stopped = m.output_to_wire(replace(out, stop_reason="ab"), 1)
    assert m.decode_core_message(m.encode(m.CoreOutputs([stopped]))).outputs[0].stop_reason == "ab"
    ready = m.Ready(12, 2048, 40, STATS, m.StoreInfo("f", 16, 256, "mha"))
    assert m.decode_core_message(m.encode(ready)) == ready
    assert m.decode_core_message(m.encode(m.Fatal("rank 1 died"))) == m.Fatal("rank 1 died")
    assert m.decode_core_message(m.encode(m.Heartbeat())) == m.Heartbeat()


def test_start_message_carries_the_whole_config():
    config = EngineConfig(model="/models/x", seed=3, engine_core_process=True,
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=128),
                          kv_transfer=KVTransferConfig(role="decode", kv_store="tcp://127.0.0.1:5557",
                                                       kv_auth_token="t" * 16))   # the token travels too
    stream = io.BytesIO()
    start = m.StartCore(config, "ipc:///run/x/down", "ipc:///run/x/up", b"\x07" * 32)
    m.write_start(stream, start)
    stream.seek(0)
    assert m.read_start(stream) == start
    assert "\\x07" not in repr(start) and "token=<hidden>" in repr(start)      # the token is never logged
    with pytest.raises(EOFError):
        m.read_start(io.BytesIO(b""))


def test_another_version_is_refused():
    data = m.encode(m.Fatal("x", version=m.VERSION + 1))
    with pytest.raises(ValueError, match="mixed pdserve versions"):
        m.decode_core_message(data)
