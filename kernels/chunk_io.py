"""Move one KV chunk, every layer at once, between the paged cache and host memory.

Used by the prefill publisher (``gather``) and the decode loader (``scatter``); the paged cache is
``KVCaches.buffer`` ``[L, C, num_blocks, block_size, Hkv, D]`` (``engine/kv/kv_layout.py``).

    gather(slots)   CPU: one index_select, done.  CUDA: on a side stream that first waits for the
                    step that computed the KV, one gather launch into a device buffer [L, C, n, Hkv, D]
                    (the compute stream waits only for that launch, so the blocks may be reused by the
                    next step), then one non-blocking copy to pinned host memory. ``Gathered.wait()``
                    (the publisher thread) blocks until the copy landed and returns the per-layer
                    objects [C, n, Hkv, D]; the engine thread never waits for the copy.
    scatter(objs, slots)   CPU: one index_copy.  CUDA (loader thread): the layer objects are packed
                    into pinned memory, copied host->device non-blocking and scattered in one
                    launch on the loader's own stream, which it then waits for; the engine keeps
                    stepping other requests on its stream meanwhile.

On CUDA the Triton kernels of ``triton_transfer.py`` do the gather/scatter; on CPU ``transfer.py``'s
torch versions (the same signatures; they are the kernels' test oracle).
"""

from __future__ import annotations

import torch

from pdserve.kernels import transfer


class Gathered:
    """One chunk copied out of the cache; ``wait()`` -> per-layer [C, n, Hkv, D] CPU tensors."""

    def __init__(self, host: torch.Tensor, done: "torch.cuda.Event | None" = None, keep=None):
        self._host, self._done, self._keep = host, done, keep

    def wait(self) -> list[torch.Tensor]:
        if self._done is not None:
            self._done.synchronize()
            self._done = self._keep = None
        return list(self._host.unbind(0))


class ChunkIO:
    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer                              # [L, C, N, bs, Hkv, D]
        self.cuda = buffer.device.type == "cuda"
        self._ops = transfer
        if self.cuda:
            from pdserve.kernels import triton_transfer

            self._ops = triton_transfer
        self._gather_stream = torch.cuda.Stream(buffer.device) if self.cuda else None
        self._scatter_stream = torch.cuda.Stream(buffer.device) if self.cuda else None

    @staticmethod
    def of(kv_caches) -> "ChunkIO | None":
        """For caches made by ``KVLayout.allocate`` (one buffer); None for anything else."""
        buffer = getattr(kv_caches, "buffer", None)
        return None if buffer is None else ChunkIO(buffer)

    def gather(self, slots: torch.Tensor) -> Gathered:
        """Engine thread, right after the step that computed the chunk."""
        if not self.cuda:
            return Gathered(self._ops.gather_chunk(self.buffer, slots))
        compute, side = torch.cuda.current_stream(self.buffer.device), self._gather_stream
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            dev = self._ops.gather_chunk(self.buffer, slots.to(self.buffer.device, non_blocking=True))
            gathered = torch.cuda.Event()
            gathered.record(side)
            host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
            host.copy_(dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        compute.wait_event(gathered)                      # the next step may overwrite these blocks
        return Gathered(host, done, keep=dev)

    def fence(self):
        """Engine thread: an event after everything the compute stream has queued (None on the CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.buffer.device))
        return event

    def scatter(self, objs: list[torch.Tensor], slots: torch.Tensor, after=None) -> None:
        """Loader thread: objs are per-layer [C, n, Hkv, D] CPU tensors for tokens at ``slots``; on CUDA the
        copy waits for ``after`` (a ``fence()`` taken when the blocks were handed to this load)."""
        if not self.cuda:
            return self._ops.scatter_chunk(self.buffer, slots, torch.stack(objs))
        host = torch.empty((len(objs), *objs[0].shape), dtype=self.buffer.dtype, pin_memory=True)
        torch.stack([o.to(self.buffer.dtype) for o in objs], out=host)
        side = self._scatter_stream
        if after is not None:
            side.wait_event(after)
        with torch.cuda.stream(side):
            dev = host.to(self.buffer.device, non_blocking=True)
            self._ops.scatter_chunk(self.buffer, slots.to(self.buffer.device, non_blocking=True), dev)
        side.synchronize()
