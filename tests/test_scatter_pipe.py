"""The loader's double-buffered scatter (issue 38, item 8) on the CPU: the same pipe a CUDA node runs.

Loads go through the real ``ChunkLoader`` (its thread, a real store, sealed objects) and must leave the cache
bit-identical to what the loader did before the pipe (per-layer ``scatter_kv``) for 1, 2 and odd chunk counts,
partial last chunks and loads that start mid-prompt. The counting test wraps the pipe's sync point and every
allocation point (the staging allocator, ``torch.empty`` / ``stack`` / ``cat`` that the old path called per chunk):
one sync per job, no allocation per chunk, the two buffers taken in turn. ``DeferredLane`` is a lane that runs
nothing until a mark is waited for -- what a slow host->device copy looks like -- so a pipe that repacked a buffer
still being read would load wrong KV here.
"""

from __future__ import annotations

import pytest
import torch

from polling import wait_until
from pdserve.decode.loader import ChunkLoader, LoadJob
from pdserve.engine.kv.kv_layout import KVLayout
from pdserve.kernels import chunk_io
from pdserve.kernels.chunk_io import ScatterBuffer
from pdserve.kernels.scatter_pipe import HostLane
from pdserve.kernels.transfer import scatter_kv
from pdserve.kvstore.auth import process_key
from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.keys import object_key
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.seal import seal
from pdserve.kvstore.tiered import TieredStore

KEY = process_key().seal_key
L, H, D, BS, CHUNK, BLOCKS = 3, 2, 8, 4, 8, 24
SHAPE = (2, H, D)                                   # (components, kv heads, head dim) of a stored object


class DeferredLane(HostLane):
    """Ops run only when a mark before them is waited for, or at sync: a copy engine far behind the host."""

    def __init__(self):
        self.ops, self.done, self.marks = [], 0, {}

    def run(self, fn):
        self.ops.append(fn)

    def mark(self, i):
        self.marks[i] = len(self.ops)

    def wait(self, i):
        self._drain(self.marks.get(i, 0))

    def sync(self):
        self._drain(len(self.ops))

    def _drain(self, upto):
        while self.done < upto:
            self.ops[self.done]()
            self.done += 1


class CountingLane(HostLane):
    def __init__(self):
        self.syncs = self.waits = 0

    def wait(self, i):
        self.waits += 1

    def sync(self):
        self.syncs += 1


@pytest.fixture()
def store():
    s = TieredStore(MemoryTier(64 << 20))
    yield s
    s.close()


def _prompt(store, dtype, lens, seed):
    """Sealed chunk objects of a prompt with chunks of ``lens`` tokens in the store -> (keys, per-chunk objects)."""
    g = torch.Generator().manual_seed(seed)
    keys, chunks = [f"p{seed}-c{i}" for i in range(len(lens))], []
    for key, n in zip(keys, lens):
        objs = [torch.randn(2, n, H, D, generator=g).to(dtype) for _ in range(L)]
        store.put([(object_key(key, layer), seal(object_key(key, layer), o, KEY)[0]) for layer, o in enumerate(objs)])
        chunks.append(objs)
    return keys, chunks


def _slots(total, seed):
    """Flat slots of positions 0..total-1 through a scrambled block table."""
    blocks = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed))[:(total + BS - 1) // BS]
    pos = torch.arange(total)
    return blocks[pos // BS] * BS + pos % BS


def _before(caches, chunks, lens, slots, start):
    """What the loader did before the pipe: each chunk's layers scattered one by one."""
    chunk_start = 0
    for objs, n in zip(chunks, lens):
        lo, hi = max(chunk_start, start), chunk_start + n
        if lo < hi:
            for cache, obj in zip(caches, objs):
                scatter_kv(cache, slots[lo:hi], obj[:, lo - chunk_start:hi - chunk_start])
        chunk_start += n


def _load(loader, job):
    """-> tokens the loader reports loaded (0 after a failure)."""
    loader.start(job)
    done = {}
    wait_until(lambda: done.update(loader.finished()) or job.request_id in done, 10, f"load {job.request_id}")
    return done[job.request_id]


def _loader(store, dtype):
    caches = KVLayout("mha", L, H, D, dtype).allocate(BLOCKS, BS)
    return ChunkLoader(store, caches, 0, SHAPE, TierHealth("t"), KEY, chunk_tokens=CHUNK), caches


CASES = [([8], 0), ([8, 8], 4), ([8, 8, 5], 0), ([8, 8, 8, 8, 3], 8)]   # chunk lens, load start (a local hit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,start", CASES)
@pytest.mark.parametrize("lane", [None, DeferredLane])
def test_loads_are_bit_identical_to_the_per_layer_scatter(store, dtype, lens, start, lane):
    loader, caches = _loader(store, dtype)
    if lane is not None:
        loader.pipe.lane = lane()
    try:
        keys, chunks = _prompt(store, dtype, lens, seed=len(lens))
        total = sum(lens)
        slots = _slots(total, seed=start)
        assert _load(loader, LoadJob("r", keys, lens, slots, start, total - start)) == total - start
        expect = KVLayout("mha", L, H, D, dtype).allocate(BLOCKS, BS)
        _before(expect, chunks, lens, slots, start)
        assert torch.equal(caches.buffer.view(torch.uint8), expect.buffer.view(torch.uint8))
    finally:
        loader.stop()


def test_deferred_lane_catches_a_pipe_that_repacks_a_busy_buffer(store, monkeypatch):
    """The harness has teeth: without the wait for buffer i, chunk i's copy reads chunk i+2's data."""
    loader, caches = _loader(store, torch.float32)
    loader.pipe.lane = DeferredLane()
    monkeypatch.setattr(DeferredLane, "wait", lambda self, i: None)
    try:
        lens = [8, 8, 8]
        keys, chunks = _prompt(store, torch.float32, lens, seed=7)
        slots = _slots(24, seed=7)
        _load(loader, LoadJob("r", keys, lens, slots, 0, 24))
        expect = KVLayout("mha", L, H, D, torch.float32).allocate(BLOCKS, BS)
        _before(expect, chunks, lens, slots, 0)
        assert not torch.equal(caches.buffer, expect.buffer)
    finally:
        loader.stop()


def test_one_sync_per_job_no_allocation_per_chunk_buffers_in_turn(store, monkeypatch):
    loader, caches = _loader(store, torch.bfloat16)
    lane = loader.pipe.lane = CountingLane()
    allocs, packs = [], []
    real_allocate, real_pack = chunk_io.allocate, ScatterBuffer.pack

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            allocs.append(name)
            return fn(*args, **kwargs)
        return wrapper

    def pack(self, objs, slots):
        packs.append(loader.pipe.buffers.index(self))
        return real_pack(self, objs, slots)

    monkeypatch.setattr(chunk_io, "allocate", counted("staging", real_allocate))
    for name in ("empty", "stack", "cat", "zeros"):
        monkeypatch.setattr(torch, name, counted(name, getattr(torch, name)))
    monkeypatch.setattr(ScatterBuffer, "pack", pack)
    try:
        jobs = [[8], [8, 8], [8, 8, 5], [8, 8, 8, 8, 3]]
        for j, lens in enumerate(jobs):
            keys, _ = _prompt(store, torch.bfloat16, lens, seed=10 + j)
            allocs.clear()
            packs.clear()
            syncs = lane.syncs
            total = sum(lens)
            assert _load(loader, LoadJob(f"r{j}", keys, lens, _slots(total, seed=j), 0, total)) == total
            assert lane.syncs - syncs == 1, f"job of {len(lens)} chunks synced {lane.syncs - syncs} times"
            assert allocs == [], f"job of {len(lens)} chunks allocated: {allocs}"
            assert packs == [i % 2 for i in range(len(lens))]
        assert loader.pipe.jobs == len(jobs) and loader.pipe.syncs == len(jobs)
        assert loader.pipe.chunks == sum(len(lens) for lens in jobs)
    finally:
        loader.stop()


def test_a_chunk_that_does_not_fit_the_staging_buffers_fails_the_load_not_the_loader(store):
    loader, caches = _loader(store, torch.float32)
    try:
        keys, _ = _prompt(store, torch.float32, [CHUNK + 4], seed=3)
        assert _load(loader, LoadJob("big", keys, [CHUNK + 4], _slots(CHUNK + 4, 3), 0, CHUNK + 4)) == 0
        assert loader.failures == 1 and not caches.buffer.any()
        keys, _ = _prompt(store, torch.float32, [CHUNK], seed=4)
        assert _load(loader, LoadJob("ok", keys, [CHUNK], _slots(CHUNK, 4), 0, CHUNK)) == CHUNK
    finally:
        loader.stop()
