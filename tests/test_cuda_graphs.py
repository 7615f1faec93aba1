"""CUDA-graph decode replay equals eager execution (needs a CUDA device: skipped on CPU, with the reason).

- bucket sizes are 1, 2, 4, multiples of 8, and --max-num-seqs itself (pure, runs everywhere);
- a decode step replayed from its graph gives the same hidden states as the eager forward on the
  same inputs (the same bits for a full bucket; a padded bucket: 3 rows replayed in the 4-row graph), also
  where --max-model-len is long enough that the graph splits the keys (both plan split-K from the bucket);
- greedy and seeded-sampled generation with graphs on equal --enforce-eager token for token.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.runner.decode_splits import buckets

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device; none here")


def test_buckets_cover_every_batch_size():
    assert buckets(1) == [1]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(64)[-3:] == [48, 56, 64]
    for n in (1, 5, 37, 256):
        sizes = buckets(n)
        assert sizes == sorted(set(sizes)) and sizes[-1] == n
        assert all(any(s >= b for s in sizes) for b in range(1, n + 1))


@needs_cuda
@pytest.mark.parametrize("max_model_len,num_prompts", [(256, 3), (4096, 3), (4096, 4)])
def test_replay_equals_eager_on_the_same_inputs(tmp_path, max_model_len, num_prompts):
    """4096: the graph splits keys 16 ways (its old plan at capture) where the old eager plan took one split; both
    now take the bucket's count (``decode_splits.py``). A full bucket (4 rows) runs the very same kernels: the
    same bits; 3 rows padded to 4 run the model's matmuls on 3 rows eagerly, so only closeness is asserted."""
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", arch="llama", seed=0, max_position_embeddings=4096)
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=8, max_model_len=max_model_len)
    runner = llm.engine.runner
    assert runner.graphs is not None and 4 in runner.graphs.graphs
    prompts = [list(range(3 + i, 150 + 20 * i)) for i in range(num_prompts)]   # 3-4 key tiles: splits get work
    for i, p in enumerate(prompts):                       # prefill each; their KV stays for the decode below
        llm.engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    sched = llm.engine.scheduler.schedule()
    runner.execute(sched)
    llm.engine.scheduler.update_from_output(sched, {f"r{i}": 3 for i in range(num_prompts)})
    sched = llm.engine.scheduler.schedule()
    inputs = runner.prepare(sched.scheduled)
    assert inputs.attn.is_decode_only and inputs.attn.num_seqs == num_prompts
    assert inputs.attn.num_splits == runner.decode_splits.for_bucket(4)
    eager = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attn)
    replayed = runner.graphs.run(inputs).clone()
    if num_prompts == 4:
        assert torch.equal(replayed, eager)
    else:
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    llm.shutdown()


@needs_cuda
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generation_with_graphs_equals_enforce_eager(tmp_path, temperature):
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", arch="llama", seed=0)
    params = [SamplingParams(max_tokens=24, temperature=temperature, seed=i, ignore_eos=True) for i in range(5)]
    prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(5)]
    runs = []
    for eager in (True, False):
        llm = LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256,
                  enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        llm.shutdown()
    assert runs[0] == runs[1]
