"""Layerwise loads (``--kv-load-layerwise``): one step's store loads read layer-major, handed to the model by layer.

Design. With the flag a request whose leading prompt chunks are in the store does not wait in WAITING_FOR_KV: the
scheduler counts the loaded range ``[start, start + n)`` as computed and schedules its tail in the same step; the
model's ``hooks.before(i)`` (``engine/kv/layer_hooks.py``) waits for layer i of every load of the step, so the tail's
layer i computes while later layers are still on their way. Every load of a step is one ``LayerBatch``, read by one
pass over the layers (a request's layer i never waits behind another request's last layer), and the batch has ended
when the step has (``end_loads``): a load never outlives the step that started it, so an abort between steps never
meets a half-written block.

Who calls what, once per step that started layerwise loads:

    engine thread   batch = connector.begin_loads()         the loads ``start_load`` queued -> loader.start_layers:
                                                            a LayerBatch for the loader thread; it is the step's hooks
    loader thread   LayerReader.load(batch)                 (``layer_reader.py``) per group of layers: one store read
                                                            of those layers of every chunk of every load, each object's
                                                            seal + shape checked, scattered into its cache layer; then
                                                            batch.layer_done(i) (CUDA: an event on the reader's stream)
                    ...after the last layer each load's chunk digests (a digest covers every layer of a chunk) are
                    compared with the prefill node's; batch.finish()
    engine thread   model: batch.before(i)                  host waits for layer_done(i); CUDA: the compute stream
                                                            waits on layer i's event (no device-wide sync)
                    connector.end_loads() -> batch.wait()   every load has ended -> the failed ones

Groups: a store read costs a round trip whatever its size, so layers are read in as many groups as the longest load
has chunks (a chunk-major load's read count; one layer per read when there are more chunks than layers).

Timeout. ``before(i)`` and ``wait()`` wait until the batch's deadline (``kv_load_layerwise_timeout_s`` from its start);
past it the engine thread ``abandon``s the batch: every load not ended fails, and under ``write_lock`` (which the loader
holds around each group's writes) ``abandoned`` is set, so no write of the loader lands after it; the step goes on.

Failure. A load that fails at layer j (object missing, seal failed, wrong shape, store error) or whose chunk digest
differs is marked failed and not read further; its later layers are released at once, so the step still ends. Its
request computed on a partial cache: the engine drops its result of the step (no token, no seeded draw) and the
scheduler rewinds it to the load's start (``Scheduler._rewind``: computed tokens back, blocks kept, nothing of the
step registered in the prefix cache), from where it recomputes. Other loads of the step are unaffected; no request
fails. Tensor/pipeline-parallel nodes keep the chunk-major load (their ranks scatter; the flag is ignored, logged).

    layer-major order:   L0: c0 c1 c2 | L1: c0 c1 c2 | ... | L(n-1): c0 c1 c2 | digests
    hooks:               before(0) waits ^            before(1) waits ^ ...
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch


TIMED_OUT = "timed out: the KV store did not answer in time"   # a load the engine gave up on (``abandon``)


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

    def __init__(self, jobs: list["LoadJob"], num_layers: int, device: torch.device, fence=None,
                 timeout_s: float | None = None):
        self.loads = [LayerLoad(job) for job in jobs]
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s   # the engine waits no longer
        self.abandoned = False                        # the deadline passed: the loader writes nothing more
        self.write_lock = threading.Lock()            # held by the loader thread around each group's writes
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
            ready = self._ready > layer
            if not ready:
                t0 = time.monotonic()
                ready = self._cond.wait_for(lambda: self._ready > layer, self._left())
                self.waited_s += time.monotonic() - t0
        if not ready:                                 # the deadline passed: the step goes on without them
            self.abandon()
        event = self.events[layer]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def abandon(self) -> None:
        """Engine thread, the deadline passed (the store hangs): every load not ended fails, no later write of the
        loader lands (it checks ``abandoned`` under ``write_lock``), the step goes on and drops those requests'
        results like any failed load's. CUDA: the compute stream waits for the writes already queued."""
        with self.write_lock:
            self.abandoned = True
            for load in self.loads:
                load.failed = load.failed or TIMED_OUT
            event = self.last_event
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        with self._cond:
            self._ready = self.num_layers
            self._cond.notify_all()

    def _left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def after(self, layer: int) -> None:
        pass

    def wait(self) -> dict[str, LayerLoad]:
        """Block until every load of the step ended (the loader thread's ``finish``) -> {request id: load}."""
        with self._cond:
            finished = self._cond.wait_for(lambda: self._finished, self._left())
        if not finished:
            self.abandon()                            # a step whose hooks did not all run: the same deadline
        if self.last_event is not None:               # the step may not have waited (no hooks ran): the next one
            torch.cuda.current_stream(self.device).wait_event(self.last_event)   # reuses no block before this
        return {load.job.request_id: load for load in self.loads}
