"""A chunk of every layer goes out of the paged cache and back bit for bit (``kernels.chunk_io`` on the CPU)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv.kv_layout import KVLayout
from pdserve.kernels.chunk_io import ChunkIO
from pdserve.kernels.scatter_pipe import ScatterPipe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_then_gather_is_bit_identical_and_touches_only_its_slots(dtype):
    caches = KVLayout("mha", 3, 2, 4, dtype).allocate(10, 4)
    io = ChunkIO.of(caches)
    assert io is not None and not io.cuda
    slots = torch.tensor([5, 6, 17, 30])                     # mid-block, two blocks, scrambled order
    g = torch.Generator().manual_seed(0)
    objs = [torch.randn(2, 4, 2, 4, generator=g).to(dtype) for _ in range(3)]   # per layer [C, n, Hkv, D]
    with ScatterPipe(io, chunk_tokens=8).job() as pipe:
        pipe.put(objs, slots)
    slot = io.ring_slots(1, tokens=8)[0]
    assert all(torch.equal(a, b) for a, b in zip(objs, io.gather(slots, slot).wait()))
    written = caches.buffer.view(3, 2, -1, 2, 4).abs().sum(dim=(0, 1, 3, 4)).nonzero().flatten().tolist()
    assert written == sorted(slots.tolist())
    assert torch.equal(caches[1]["v"].view(-1, 2, 4)[17], objs[1][1, 2])   # the per-layer views see it
