"""A decode step is staged straight into the CUDA graphs' static buffers: one copy, and none before the replay.

Runs on CPU with the graphs' own buffer logic (``engine/runner/graph_inputs.py``, ``DecodeGraphs.prepare``); the
GPU half (the replay itself) is ``tests/test_cuda_graphs.py``. ``Tensor.copy_`` and ``Tensor.fill_`` are counted
while a step is staged and while its replay is prepared: before, a replay copied 5 inputs and filled 2 from the
staging buffer on every step.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pdserve.engine.runner.cuda_graphs import DecodeGraphs
from pdserve.engine.runner.decode_splits import DecodeSplits
from pdserve.engine.runner.staging import StepArrays, StepStaging

BLOCK_SIZE, MAX_MODEL_LEN = 4, 64     # 16 blocks per row


@contextmanager
def counted():
    """{"copy_": n, "fill_": n}: the tensor copies and fills made inside the block."""
    counts = {"copy_": 0, "fill_": 0}
    originals = {name: getattr(torch.Tensor, name) for name in counts}

    def wrap(name):
        def call(self, *args, **kwargs):
            counts[name] += 1
            return originals[name](self, *args, **kwargs)
        return call

    for name in counts:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def decode_step(n: int, seed: int = 0) -> StepArrays:
    """n decode rows with random lengths and block tables."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, MAX_MODEL_LEN, n).astype(np.int32)
    nb = -(-int(lens.max()) // BLOCK_SIZE)
    table = rng.integers(1, 100, (n, nb)).astype(np.int32)
    pos = lens.astype(np.int64) - 1
    slots = table[np.arange(n), pos // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    return StepArrays(input_ids=rng.integers(0, 1000, n), positions=pos, slot_mapping=slots,
                      query_start_loc=np.arange(n + 1, dtype=np.int32), seq_lens=lens, block_table=table,
                      sample_rows=np.arange(n, dtype=np.int64))


@pytest.fixture
def graphs() -> DecodeGraphs:
    """The graphs' buffers and metadata on CPU (nothing captured), max_num_seqs 8: buckets 1, 2, 4, 8."""
    runner = SimpleNamespace(model=None, block_size=BLOCK_SIZE, device=torch.device("cpu"),
                             decode_splits=DecodeSplits(8, MAX_MODEL_LEN, 2))
    return DecodeGraphs(runner, MAX_MODEL_LEN)


def staging_into(graphs) -> StepStaging:
    staging = StepStaging(torch.device("cpu"))
    staging.graph_inputs = graphs.inputs             # as ModelRunner wires it once the graphs are captured
    return staging


@pytest.mark.parametrize("n", [1, 3, 8])
def test_a_staged_step_needs_no_copy_before_its_replay(graphs, n):
    a = decode_step(n)
    with counted() as staging:
        inputs = staging_into(graphs).stage(a, [], BLOCK_SIZE, "triton")
    assert staging == {"copy_": 1, "fill_": 0}               # the step's one host -> device copy
    with counted() as replay:
        bucket = graphs.prepare(inputs)
    assert replay == {"copy_": 0, "fill_": 0}
    assert bucket == inputs.graph_bucket == graphs.splits.bucket(n)
    _assert_buffers_hold(graphs, a, n, bucket)


def test_a_step_staged_elsewhere_is_still_copied_in(graphs):
    """The fallback (a step not staged by the graphs' staging): the old per-replay copies and padding fills."""
    a = decode_step(3, seed=1)
    inputs = StepStaging(torch.device("cpu")).stage(a, [], BLOCK_SIZE, "triton")
    assert not graphs.inputs.holds(inputs)
    with counted() as replay:
        bucket = graphs.prepare(inputs)
    assert replay == {"copy_": 5, "fill_": 2}
    _assert_buffers_hold(graphs, a, 3, bucket)


def test_steps_the_graphs_cannot_replay_are_staged_as_before(graphs):
    staging = staging_into(graphs)
    too_many = staging.stage(decode_step(9), [], BLOCK_SIZE, "triton")
    prefill = decode_step(2)
    prefill.query_start_loc = np.array([0, 2, 3], np.int32)
    prefill.input_ids, prefill.positions = np.arange(3), np.array([0, 1, 5])
    prefill.slot_mapping = np.array([8, 9, 12])
    mixed = staging.stage(prefill, [], BLOCK_SIZE, "triton")
    torch_backend = staging.stage(decode_step(2), [], BLOCK_SIZE, "torch")
    assert all(s.graph_bucket is None and not graphs.inputs.holds(s) for s in (too_many, mixed, torch_backend))


def test_consecutive_steps_alternate_host_buffers_and_pad_each_bucket(graphs):
    staging = staging_into(graphs)
    for n, seed in ((8, 2), (3, 3), (5, 4), (1, 5)):         # a shrinking batch re-pads its bucket
        a = decode_step(n, seed)
        inputs = staging.stage(a, [], BLOCK_SIZE, "triton")
        _assert_buffers_hold(graphs, a, n, graphs.prepare(inputs))
        eager = inputs.attn
        assert torch.equal(eager.block_table[:, :a.block_table.shape[1]], torch.from_numpy(a.block_table))
        assert eager.max_seq_len == int(a.seq_lens.max()) and eager.max_query_len == 1


def _assert_buffers_hold(graphs, a: StepArrays, n: int, bucket: int) -> None:
    """The graph of ``bucket`` reads the step's n rows and padding rows n..bucket (slot -1, seq_len 1)."""
    meta = graphs._meta(bucket)
    assert graphs.ids[:n].tolist() == a.input_ids.tolist()
    assert graphs.positions[:n].tolist() == a.positions.tolist()
    assert meta.slot_mapping.tolist() == a.slot_mapping.tolist() + [-1] * (bucket - n)
    assert meta.seq_lens.tolist() == a.seq_lens.tolist() + [1] * (bucket - n)
    assert meta.query_start_loc.tolist() == list(range(bucket + 1))
    nb = a.block_table.shape[1]
    assert torch.equal(meta.block_table[:n, :nb], torch.from_numpy(a.block_table))
