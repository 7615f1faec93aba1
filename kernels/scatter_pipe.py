"""The loader's double-buffered scatter: chunk i+1 is packed on the host while chunk i moves to the cache.

Who calls what (the loader thread alone: ``ChunkLoader`` owns one pipe, its buffers and its lane):

    with pipe.job(after=fence):          one load job; the only sync is at the end of the block (lane.sync)
        pipe.put(layer_objs, slots)      per chunk: wait until buffer (i % 2) is free again, pack the layer objects
                                         and the slots into it (host copies), then queue copy-in + scatter on the
                                         lane and mark buffer (i % 2) busy until they are done

    buffer 0   pack c0 | (c0 -> cache on the lane) ............ | pack c2 | (c2 -> cache) ...
    buffer 1             pack c1 | (c1 -> cache on the lane) .............. | pack c3 ...

The lane is where the copies run. ``CudaLane``: the loader's own stream (host -> device copy from pinned memory
into a device staging buffer, one scatter launch); its marks are two reusable events. ``HostLane`` (a CPU node):
the scatter runs at once from the staging buffer, every mark is already passed -- the same code path, the same
buffer reuse. A lane runs ops in the order they were queued; ``wait(i)`` returns once everything queued before
``mark(i)`` is done; ``sync()`` once everything is.

Buffers: ``ChunkIO.scatter_buffers``' two sets (host kv + slots; on CUDA a device copy of each), made once when the
pipe is made; a chunk larger than ``chunk_tokens`` is refused.
"""

from __future__ import annotations

import contextlib

import torch


class HostLane:
    """CPU: ops run at once on the calling thread."""

    def after(self, fence) -> None:
        pass

    def run(self, fn) -> None:
        fn()

    def mark(self, i: int) -> None:
        pass

    def wait(self, i: int) -> None:
        pass

    def sync(self) -> None:
        pass


class CudaLane:
    """CUDA: ops are queued on the loader's stream; marks are two events recorded on it (made once)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.events = [torch.cuda.Event(), torch.cuda.Event()]

    def after(self, fence) -> None:
        """The copies of this job wait for ``fence`` (the compute stream when the blocks were handed over)."""
        if fence is not None:
            self.stream.wait_event(fence)

    def run(self, fn) -> None:
        with torch.cuda.stream(self.stream):
            fn()

    def mark(self, i: int) -> None:
        self.events[i].record(self.stream)

    def wait(self, i: int) -> None:
        self.events[i].synchronize()        # never recorded yet: returns at once

    def sync(self) -> None:
        self.stream.synchronize()


class ScatterPipe:
    def __init__(self, io, chunk_tokens: int, lane=None):
        self.io = io                                            # ChunkIO: the cache and its scatter op
        self.buffers = io.scatter_buffers(chunk_tokens)
        self.lane = lane if lane is not None else (CudaLane(io.buffer.device) if io.cuda else HostLane())
        self._turn = 0
        self.jobs = self.chunks = self.syncs = 0

    @contextlib.contextmanager
    def job(self, after=None):
        """One load job: its chunks' scatters have all landed when the block exits (even on an error)."""
        self.lane.after(after)
        self._turn = 0
        self.jobs += 1
        try:
            yield self
        finally:
            self._sync()

    def put(self, objs: list[torch.Tensor], slots: torch.Tensor) -> None:
        """Queue per-layer objects [C, n, Hkv, D] (CPU, any strides) for the cache ``slots`` [n]."""
        i, self._turn = self._turn, self._turn ^ 1
        self.lane.wait(i)                                       # the chunk two back is done with buffer i
        self.lane.run(self.buffers[i].pack(objs, slots))         # the pack is done here; the copy-in is queued
        self.lane.mark(i)
        self.chunks += 1

    def _sync(self) -> None:
        """The one host wait of a job."""
        self.syncs += 1
        self.lane.sync()
