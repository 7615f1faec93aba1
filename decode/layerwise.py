"""Layerwise loads: one step's store loads read layer-major and handed to the model layer by layer.

With ``--kv-load-layerwise`` a request whose leading prompt chunks are in the store does not wait in
WAITING_FOR_KV: the scheduler counts the loaded range as computed and schedules its tail in the same step, and the
model's ``hooks.before(i)`` (``engine/kv/layer_hooks.py``) waits for layer i of every load of the step. So the tail's
layer i computes while layers i+1.. are still on their way.

Who calls what, once per step that started layerwise loads:

    engine thread   batch = connector.begin_step()          LayerBatch of the loads ``start_load`` queued, handed
                                                            to the loader thread; it is the step's LayerHooks
    loader thread   ChunkLoader._load_layers(batch)         for layer i: one store read of layer i of every chunk
                                                            of every load, seal + shape check, scatter into cache i;
                                                            then batch.layer_done(i)  (CUDA: an event on its stream)
                    ...after the last layer: each load's chunk digests (all layers of a chunk) are compared;
                    batch.finish()
    engine thread   model: batch.before(i)                  host waits for layer_done(i); CUDA: the compute stream
                                                            waits on layer i's event (no device-wide sync)
                    connector.end_step() -> batch.wait()    every load of the step has ended; the failed ones

A load that fails at layer j (object missing, seal failed, wrong shape, store error) or whose chunk digest differs
is marked failed; later layers are released at once (nothing more is read for it), so the step still ends. Its
request computed on a partial cache: the engine drops its result of the step and the scheduler rewinds it to the
load's start (its local prefix), from where it recomputes. The other loads of the step are unaffected.

    layer-major order:   L0: c0 c1 c2 | L1: c0 c1 c2 | ... | L(n-1): c0 c1 c2 | digests
    hooks:               before(0) waits ^            before(1) waits ^ ...
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.decode.loader import LoadJob


@dataclass
class LayerLoad:
    """One request's layerwise load; ``macs[c]``: the seal MACs of chunk c's layers, in layer order."""
    job: "LoadJob"
    failed: str = ""                                  # why it failed ("" while it has not)
    macs: dict[int, list[bytes]] = field(default_factory=dict)

    @property
    def loaded(self) -> int:
        return 0 if self.failed else self.job.num_tokens


class LayerBatch:
    """The layerwise loads of one step: filled by the loader thread, waited on by the model's layer hooks."""

    def __init__(self, jobs: list["LoadJob"], num_layers: int, device: torch.device, fence=None):
        self.loads = [LayerLoad(job) for job in jobs]
        self.num_layers = num_layers
        self.device = device                          # the cache's device (CUDA: whose compute stream waits)
        self.fence = fence                            # CUDA: the compute stream when the blocks were handed over
        self.events: list = [None] * num_layers       # CUDA: layer i is in the cache once events[i] has passed
        self._ready = 0                               # layers the loader thread has handed over
        self._finished = False
        self.last_event = None                        # CUDA: after every write of the batch (``finish``)
        self._cond = threading.Condition()
        self.waited_s = 0.0                           # engine thread's time blocked in before()

    # -- loader thread ---------------------------------------------------------------------------

    def layer_done(self, layer: int, event=None) -> None:
        self.events[layer] = event
        with self._cond:
            self._ready = layer + 1
            self._cond.notify_all()

    def finish(self, event=None) -> None:
        """Every load ended; CUDA: ``event`` follows every write the loader queued for this batch."""
        self.last_event = event
        with self._cond:
            self._ready, self._finished = self.num_layers, True
            self._cond.notify_all()

    # -- engine thread: LayerHooks ------------------------------------------------------------------

    def before(self, layer: int) -> None:
        with self._cond:
            if self._ready <= layer:
                t0 = time.monotonic()
                self._cond.wait_for(lambda: self._ready > layer)
                self.waited_s += time.monotonic() - t0
        event = self.events[layer]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def after(self, layer: int) -> None:
        pass

    def wait(self) -> dict[str, LayerLoad]:
        """Block until every load of the step ended (the loader thread's ``finish``) -> {request id: load}."""
        with self._cond:
            self._cond.wait_for(lambda: self._finished)
        if self.last_event is not None:               # the step may not have waited (no hooks ran): the next one
            torch.cuda.current_stream(self.device).wait_event(self.last_event)   # reuses no block before this
        return {load.job.request_id: load for load in self.loads}
