"""Layerwise publish: a step's completed chunks go to the store layer by layer while later layers still compute.

Who calls what, on a step that completes prompt chunks (``--kv-publish-layerwise``):

    engine thread, before the forward   StoreConnector.begin_step(scheduled)
                                          for each chunk the step will complete (the scheduler's tokens say which):
                                          publisher.start_layers -> a ring slot (may wait: back-pressure) -> LayerChunk
                                          -> a LayerwisePublish, set on the step's AttentionMetadata.layer_hooks
    model, after layer i                hooks.after(i): layer i of each chunk into its slot (ChunkIO.gather_layer:
                                          a copy on the CPU; on CUDA a device gather + an async copy to pinned
                                          memory, with an event), then queued: the publisher thread seals and puts
                                          object (chunk, i) while layers i+1.. compute; after the last layer the
                                          chunk's end is queued
    engine thread, after the forward    StoreConnector.after_step -> hooks.finish(): layers no hook took (a replayed
                                          CUDA graph, a model without hooks) are gathered now, every chunk ended,
                                          skips queued (in chunk order, after the ends); on CUDA the compute stream
                                          waits for the gathers before blocks may be reused
    the forward raised                  StoreConnector.abandon_step -> hooks.abandon(): chunks not ended end failed

    publisher thread                    per layer: wait for the copy, seal (a copy out of the slot), put; the
                                          chunk's slot goes back once its last layer is sealed; at its end the
                                          chunk is acknowledged (flushed when ``durable``) only if every layer
                                          was, and its digest is that of its layers' MACs, as per step

A layer object is the same bytes the per-step path would store (the same gather of the same cache rows, the
same seal), so a decode node cannot tell the two apart.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pdserve.kernels.publish_ring import RingSlot

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class LayerChunk:
    """One chunk published layer by layer; the engine thread writes ``queued``/``ended``, the publisher thread
    ``macs``/``failed`` (each field has one writer)."""
    pending: object                     # the request's _Pending when the chunk was queued (it settles that one)
    request_id: str
    index: int
    chunk_key: str
    slots: torch.Tensor                 # [n] the chunk's cache slots
    slot: RingSlot | None               # held until the last layer is sealed
    num_layers: int
    queued: int = 0                     # layers handed to the publisher thread
    ended: bool = False
    failed: bool = False
    macs: list = field(default_factory=list)

    def give_back_slot(self, release) -> None:
        """Publisher thread; idempotent."""
        slot, self.slot = self.slot, None
        if slot is not None:
            release(slot)


@dataclass
class LayerWork:
    """Publisher-thread work: seal and put layer ``layer`` of ``chunk`` once ``gathered`` landed."""
    chunk: LayerChunk
    layer: int
    gathered: object                    # kernels.chunk_io.Gathered


class LayerwisePublish:
    """The step's ``LayerHooks`` for publishing (``engine/kv/layer_hooks.py``); ``skips``: (request id, chunk index,
    chunk key) of chunks that found no ring slot, queued as failures by ``finish``; ``failed``: requests a gather
    failed for -- the connector publishes nothing more of them (nothing after a gap)."""

    def __init__(self, publisher, chunks: list[LayerChunk], skips: list[tuple[str, int, str]]):
        self.publisher, self.chunks, self.skips = publisher, chunks, skips
        self.failed: set[str] = set()

    def before(self, layer: int) -> None:
        pass

    def after(self, layer: int) -> None:
        for chunk in self.chunks:
            if chunk.queued == layer and not chunk.ended:      # in order, once (a second forward is ignored)
                self._next_layer(chunk)

    def finish(self) -> None:
        """After the forward: take what no hook took, end every chunk, queue the skips, hold the blocks (CUDA)."""
        for chunk in self.chunks:
            while not chunk.ended:
                self._next_layer(chunk)
        for request_id, index, chunk_key in self.skips:
            self.publisher.skip(request_id, index, chunk_key)
        self.publisher.hold_blocks()

    def _next_layer(self, chunk: LayerChunk) -> None:
        """Hand the chunk's next layer over (and its end after the last); a gather that raises ends the chunk
        unpublished, and the request's later chunks of the step with it (nothing after a gap) -- the step goes on."""
        try:
            self.publisher.put_layer(chunk)
        except Exception as exc:  # noqa: BLE001 - a miss for the decode node, never a failed step
            logger.warning("publishing layer %d of %s's chunk %d failed (%s: %s); its later chunks are not "
                           "published", chunk.queued, chunk.request_id, chunk.index, type(exc).__name__, exc)
            self.publisher.failures += 1
            self.failed.add(chunk.request_id)
            for later in self.chunks:               # in index order: answered in order after this one
                if later.request_id == chunk.request_id and later.index >= chunk.index and not later.ended:
                    self.publisher.end_chunk(later, failed=True)
            return
        if chunk.queued == chunk.num_layers:
            self.publisher.end_chunk(chunk)

    def abandon(self) -> None:
        """The forward raised: what was queued is put, but no chunk of this step counts as published."""
        for chunk in self.chunks:
            if not chunk.ended:
                self.publisher.end_chunk(chunk, failed=True)
        for request_id, index, chunk_key in self.skips:
            self.publisher.skip(request_id, index, chunk_key)
        self.publisher.hold_blocks()
