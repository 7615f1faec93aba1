"""Eager decode steps take the split-K count of their CUDA-graph bucket, so replay and --enforce-eager agree bitwise.

The Triton kernel's split count sets its summation order. A graph fixes the count at capture (its metadata says
max_seq_len = max_model_len); an eager step used to plan from its own max_seq_len, e.g. 1 split against the
graph's 16 for a short context under a 4096-token --max-model-len. Both now plan from the bucket and the KV-head
count (``engine/runner/decode_splits.py``). The graph side runs here without a graph: the step is staged straight into
the static buffers as the engine stages it (``graph_inputs.py``; or, ``loaded``, staged apart and copied in by
``DecodeGraphs.load``), ``_forward(b)`` runs the kernels a capture records, on CPU in Triton's interpreter (fp32),
against an eager forward on the step staged apart.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton and the kernel modules are imported

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from pdserve.engine.runner.decode_splits import DecodeSplits  # noqa: E402
from pdserve.kernels import AttentionMetadata  # noqa: E402
from pdserve.kernels.split_k import MAX_SPLITS, MIN_SPLIT_KEYS, decode_splits, splits_for  # noqa: E402

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="runs the Triton kernels on CPU in the interpreter (triton installed, TRITON_INTERPRET=1); on a GPU "
           "tests/test_cuda_graphs.py checks the same against real graphs")


def _decode_meta(seq_lens: list[int], max_seq_len: int | None = None) -> AttentionMetadata:
    n = len(seq_lens)
    meta = AttentionMetadata.build([1] * n, seq_lens, [[1 + i] for i in range(n)], 4096, backend="triton")
    meta.max_seq_len = max_seq_len or meta.max_seq_len
    return meta


def test_decode_steps_plan_from_the_bucket_not_their_lengths():
    rule = DecodeSplits(max_num_seqs=20, max_model_len=4096, num_kv_heads=2)
    assert [rule.bucket(n) for n in (1, 3, 4, 5, 9, 20, 21)] == [1, 4, 4, 8, 16, 20, 21]
    for n in (1, 3, 7, 20):
        short, long = _decode_meta([5] * n), _decode_meta([5] * n, max_seq_len=4000)
        rule.apply(short)
        rule.apply(long)
        assert short.num_splits == long.num_splits == rule.for_bucket(rule.bucket(n)) == \
            decode_splits(rule.bucket(n), 2, 4096)
    assert rule.for_bucket(4) == min(-(-264 // 8), 4096 // MIN_SPLIT_KEYS, MAX_SPLITS) == 16
    assert splits_for(8, 40) == 1                          # the old eager plan of that step: one split


def test_prefill_and_other_backends_keep_the_kernels_plan():
    rule = DecodeSplits(8, 4096, 2)
    mixed = AttentionMetadata.build([3, 1], [9, 5], [[1, 2, 3], [4]], 4, backend="triton")
    torch_decode = _decode_meta([5, 6])
    torch_decode.backend = "torch"
    for meta in (mixed, torch_decode):
        rule.apply(meta)
        assert meta.num_splits is None


@interpreted
@pytest.mark.parametrize("staged", [True, False], ids=["staged", "loaded"])
@pytest.mark.parametrize("num_prompts", [3, 4])                     # 3: padded to bucket 4
def test_eager_decode_equals_the_graph_plan_bitwise(tmp_path, num_prompts, staged):
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model
    from pdserve.engine.runner.cuda_graphs import DecodeGraphs

    model_dir = make_tiny_model(tmp_path / "m", arch="llama", seed=0, max_position_embeddings=4096)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", attention_backend="triton", max_num_seqs=8,
              max_model_len=4096, block_size=16, enable_prefix_caching=False)
    runner, engine = llm.engine.runner, llm.engine
    prompts = [list(range(3 + i, 150 + 20 * i)) for i in range(num_prompts)]   # 3-4 key tiles of 64: splits work
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    sched = engine.scheduler.schedule()
    runner.execute(sched)                                            # the prefills; their K/V stays for the decode
    engine.scheduler.update_from_output(sched, {f"r{i}": 7 for i in range(num_prompts)})
    scheduled = engine.scheduler.schedule().scheduled
    inputs = runner.prepare(scheduled)
    assert inputs.attn.is_decode_only and inputs.attn.num_seqs == num_prompts
    assert inputs.attn.num_splits == 16 and splits_for(8, inputs.attn.max_seq_len) == 1   # the rules that differed
    eager = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attn)
    graphs = DecodeGraphs(runner, 4096)                              # the buffers and metadata a capture uses
    if staged:                                                       # as ModelRunner wires it under graphs
        runner.input_batch.staging.graph_inputs = graphs.inputs
        inputs = runner.prepare(scheduled)                           # the same step again, into the buffers
        assert graphs.inputs.holds(inputs) and inputs.graph_bucket == 4
    b = graphs.prepare(inputs)
    assert b == 4 and graphs._meta(b).num_splits == 16
    replayed = graphs._forward(b)[:num_prompts]
    assert torch.equal(replayed, eager)
    llm.shutdown()
