"""Move one KV chunk, every layer at once, between the paged cache and reusable staging buffers.

Used by the prefill publisher (``gather`` into a publish-ring slot) and the decode loader (``ScatterPipe`` over its
two ``scatter_buffers``); the paged cache is ``KVCaches.buffer`` ``[L, C, num_blocks, block_size, Hkv, D]``
(``engine/kv/kv_layout.py``). No chunk-sized memory is allocated per chunk: every buffer is made once
(``kernels/staging.py``) and owned as described where it is made.

    gather(slots, slot)  engine thread, into a ring slot the engine thread acquired (``publish_ring.py``).
                    CPU: one index_select into the slot's host buffer, done.  CUDA: on a side stream that first
                    waits for the step that computed the KV, one gather launch into the slot's device buffer (the
                    compute stream waits only for that launch, so the blocks may be reused by the next step), then
                    one non-blocking copy to the slot's pinned host buffer. ``Gathered.wait()`` (the publisher
                    thread) blocks until the copy landed and returns per-layer views [C, n, Hkv, D] of the slot;
                    ``Gathered.release()`` hands the slot back once they are no longer read.
    gather_layer(i, slots, slot, first)  the same for layer i alone, while later layers still compute (a layerwise
                    publish, ``prefill/layerwise.py``): into the slot's part for layer i; on CUDA the side stream
                    waits for the compute stream so far, and ``hold_blocks()`` after the step makes the compute
                    stream wait for the last gather before the next step may reuse the blocks.
    scatter_buffers(tokens)  the loader's two double-buffering sets (``scatter_pipe.py``): ``pack`` copies the
                    layer objects and slots into its host memory (pinned on CUDA) on the loader thread and returns
                    the op that moves them into the cache (CUDA: H2D into its device buffer, one scatter launch; run
                    on the loader's stream by the pipe's lane).

On CUDA the Triton kernels of ``triton_transfer.py`` do the gather/scatter; on CPU ``transfer.py``'s
torch versions (the same signatures; they are the kernels' test oracle).
"""

from __future__ import annotations

import functools

import torch

from pdserve.kernels import transfer
from pdserve.kernels.publish_ring import RingSlot
from pdserve.kernels.staging import SlotIndex, Staging, allocate, numel

_CPU = torch.device("cpu")


class Gathered:
    """One chunk copied out of the cache; ``wait()`` -> per-layer [C, n, Hkv, D] CPU tensors, ``release()`` once
    they are no longer read (the publisher thread: after sealing copied them out)."""

    def __init__(self, host, done: "torch.cuda.Event | None" = None, release=None):
        self._host, self._done, self._release = host, done, release

    def wait(self) -> list[torch.Tensor]:
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return list(self._host.unbind(0)) if isinstance(self._host, torch.Tensor) else list(self._host)

    def release(self) -> None:
        """Idempotent; the views ``wait`` returned must not be read afterwards (the slot is rewritten)."""
        release, self._release, self._host = self._release, None, None
        if release is not None:
            release()


class ChunkIO:
    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer                              # [L, C, N, bs, Hkv, D]
        self.cuda = buffer.device.type == "cuda"
        self._ops = transfer
        if self.cuda:
            from pdserve.kernels import triton_transfer

            self._ops = triton_transfer
        self._gather_stream = torch.cuda.Stream(buffer.device) if self.cuda else None
        self._last_gather = None                          # CUDA: the last layerwise gather (``hold_blocks``)

    @staticmethod
    def of(kv_caches) -> "ChunkIO | None":
        """For caches made by ``KVLayout.allocate`` (one buffer); None for anything else."""
        buffer = getattr(kv_caches, "buffer", None)
        return None if buffer is None else ChunkIO(buffer)

    def chunk_bytes(self, tokens: int) -> int:
        """Bytes of one copy of a ``tokens``-token chunk of every layer."""
        L, C, _, _, h, d = self.buffer.shape
        return L * C * tokens * h * d * self.buffer.element_size()

    def _stagings(self, count: int, tokens: int, device: torch.device) -> list[Staging]:
        """``count`` chunk buffers carved out of one allocation (pinned when it is a CUDA node's host side)."""
        L, C, _, _, h, d = self.buffer.shape
        k = numel((L, C), (h, d), tokens)
        flat = allocate(count * k, self.buffer.dtype, device, pin=self.cuda and device.type == "cpu")
        return [Staging((L, C), (h, d), tokens, flat[i * k:(i + 1) * k]) for i in range(count)]

    def _indices(self, count: int, tokens: int, device: torch.device) -> list[SlotIndex]:
        flat = allocate(count * tokens, torch.long, device, pin=self.cuda and device.type == "cpu")
        return [SlotIndex(flat[i * tokens:(i + 1) * tokens]) for i in range(count)]

    # -- publish -------------------------------------------------------------------------------

    def ring_slots(self, count: int, tokens: int) -> list[RingSlot]:
        """The publish ring's ``count`` slots for chunks of up to ``tokens`` tokens: host buffers (pinned on CUDA)
        and, on CUDA, device twins with room for the chunk's slot ids; one allocation per kind."""
        hosts = self._stagings(count, tokens, _CPU)
        if not self.cuda:
            return [RingSlot(i, host.nbytes, host) for i, host in enumerate(hosts)]
        device = self.buffer.device
        devs, indices = self._stagings(count, tokens, device), self._indices(count, tokens, device)
        return [RingSlot(i, h.nbytes, h, dv, ix) for i, (h, dv, ix) in enumerate(zip(hosts, devs, indices))]

    def gather(self, slots: torch.Tensor, slot: RingSlot, release=None) -> Gathered:
        """Engine thread, right after the step that computed the chunk; ``slot`` is the engine thread's until
        the returned ``Gathered`` is queued (then the publisher thread's: its ``release()`` calls ``release``)."""
        n = slots.shape[0]
        host = slot.host.view(n)
        if not self.cuda:
            return Gathered(self._ops.gather_chunk(self.buffer, slots, out=host), release=release)
        compute, side = torch.cuda.current_stream(self.buffer.device), self._gather_stream
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            index = slot.dev_index.view(n)
            index.copy_(slots, non_blocking=True)         # ordered after the slot's previous use on this stream
            dev = self._ops.gather_chunk(self.buffer, index, out=slot.dev.view(n))
            gathered = torch.cuda.Event()
            gathered.record(side)
            host.copy_(dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        compute.wait_event(gathered)                      # the next step may overwrite these blocks
        return Gathered(host, done, release)

    def gather_layer(self, layer: int, slots: torch.Tensor, slot: RingSlot, first: bool) -> Gathered:
        """Engine thread, right after ``layer`` ran (a layerwise publish): that layer of the chunk at ``slots`` into
        ``slot``'s part for it; ``first``: the chunk's first layer gathered (CUDA: its slot ids go to the device
        once). The slot stays the caller's (its ``Gathered.release`` is a no-op); on CUDA the compute stream does
        not wait here: ``hold_blocks`` makes it wait for every gather before blocks may be reused."""
        n = slots.shape[0]
        host = slot.host.view(n)[layer:layer + 1]                          # [1, C, n, Hkv, D]
        kv = self.buffer[layer:layer + 1]                                  # [1, C, N, bs, Hkv, D]
        if not self.cuda:
            return Gathered(self._ops.gather_chunk(kv, slots, out=host))
        compute, side = torch.cuda.current_stream(self.buffer.device), self._gather_stream
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            index = slot.dev_index.view(n)
            if first:
                index.copy_(slots, non_blocking=True)     # ordered after the slot's previous use on this stream
            dev = self._ops.gather_chunk(kv, index, out=slot.dev.view(n)[layer:layer + 1])
            self._last_gather = torch.cuda.Event()
            self._last_gather.record(side)
            host.copy_(dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        return Gathered(host, done)

    def hold_blocks(self) -> None:
        """Engine thread, after a layerwise step: the compute stream waits for the gathers issued so far (not for
        their copies to the host) before anything it queues next may overwrite the blocks they read."""
        if self.cuda and self._last_gather is not None:
            torch.cuda.current_stream(self.buffer.device).wait_event(self._last_gather)
            self._last_gather = None

    def fence(self):
        """Engine thread: an event after everything the compute stream has queued (None on the CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.buffer.device))
        return event

    # -- load ----------------------------------------------------------------------------------

    def scatter_buffers(self, tokens: int, count: int = 2) -> list["ScatterBuffer"]:
        """The loader pipe's staging sets for chunks of up to ``tokens`` tokens (one allocation per kind)."""
        hosts, host_ix = self._stagings(count, tokens, _CPU), self._indices(count, tokens, _CPU)
        if not self.cuda:
            return [ScatterBuffer(self, h, ix) for h, ix in zip(hosts, host_ix)]
        device = self.buffer.device
        devs, dev_ix = self._stagings(count, tokens, device), self._indices(count, tokens, device)
        return [ScatterBuffer(self, *b) for b in zip(hosts, host_ix, devs, dev_ix)]


class ScatterBuffer:
    """One of the loader pipe's two staging sets; the loader thread owns it (``scatter_pipe.py`` says when it is
    free to pack again). ``dev``/``dev_index``: the device twins on CUDA, None on a CPU node."""

    def __init__(self, io: ChunkIO, host: Staging, host_index: SlotIndex, dev: Staging | None = None,
                 dev_index: SlotIndex | None = None):
        self.io, self.host, self.host_index, self.dev, self.dev_index = io, host, host_index, dev, dev_index

    def pack(self, objs: list[torch.Tensor], slots: torch.Tensor):
        """Copy per-layer objects [C, n, Hkv, D] (cast to the cache dtype) and ``slots`` [n] into the host buffer;
        -> the op that moves them into the cache (for the pipe's lane to run)."""
        n = slots.shape[0]
        kv = self.host.view(n)
        if len(objs) != kv.shape[0]:
            raise ValueError(f"{len(objs)} layer objects for a cache of {kv.shape[0]} layers")
        for layer, obj in zip(kv, objs):
            if obj.shape != layer.shape:
                raise ValueError(f"layer object {tuple(obj.shape)} where {tuple(layer.shape)} belongs")
            layer.copy_(obj)
        self.host_index.view(n).copy_(slots)
        return functools.partial(self._to_cache, n)

    def _to_cache(self, n: int) -> None:
        kv, index = self.host.view(n), self.host_index.view(n)
        if self.dev is not None:                          # CUDA, on the lane's stream
            kv = self.dev.view(n).copy_(kv, non_blocking=True)
            index = self.dev_index.view(n).copy_(index, non_blocking=True)
        self.io._ops.scatter_chunk(self.io.buffer, index, kv)
